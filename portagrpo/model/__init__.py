"""The model: loading.py (tokenizer, tiny model, local checkpoints, LoRA), scorer.py (the response
scorer: forward to per-token log-probs/entropy through a kernel), parallel.py (replicated, DDP, FSDP2)."""

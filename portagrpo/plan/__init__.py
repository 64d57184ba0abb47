"""The memory plan of a run, before it starts: memory.py (the arithmetic: per-rank bytes of each phase, the host, the
advice), shapes.py (the model's shape from its config.json, or a shipped one), gate.py (the plan of a config on its
cluster and the sentence that stops a run whose plan does not fit). `portagrpo plan` is tools/plan.py."""

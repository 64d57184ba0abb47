"""Ulysses in the trainer on 2 CPU ranks (gloo, FSDP2, fp64): a sequence-parallel group of 2 trains as 2 data-parallel
ranks do, with a scoring pass (2 PPO epochs: each rank brings its share, the group scores the union), the KL
reference, and token-budget micro-batches (the budget is per rank, so per group 2x), step for step to fp64 rounding
(DDP on a torch whose FSDP2 averages fp64 gradients)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_data_parallel import ENV  # noqa: E402

RUN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=2",
       "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "rollout.engine=fixed",
       "trainer.nproc_per_node=2", "model.dtype=fp64", "data.max_response_length=40",
       "actor.kl_loss_coef=0.1", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=72"]


def train(out: Path, sp: int, parallel: str) -> list[dict]:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(out), *RUN,
           f"trainer.parallel={parallel}", f"actor.ulysses_sequence_parallel_size={sp}"]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_sequence_parallel_group_trains_as_data_parallel_ranks(tmp_path):
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    parallel = "ddp" if fsdp2_problem(torch.float64) else "fsdp2"  # the oldest stack's FSDP2 averages fp64 gradients
    dp, sp = train(tmp_path / "dp", 1, parallel), train(tmp_path / "sp", 2, parallel)
    assert len(dp) == len(sp) == 2
    for a, b in zip(dp, sp):
        for key in ("loss_policy", "grad_norm", "kl", "entropy", "ppo_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-10, abs=1e-12), key


def _gqa_model(path: Path) -> Path:
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads) saved with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.model.loading import load_tokenizer

    tokenizer = load_tokenizer(None, "model.path")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(5)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_four_ranks_as_one_sequence_parallel_group_train_as_four_data_parallel_ranks(tmp_path):
    """SP=4 on 4 ranks (one group: data parallelism 1) against SP=1 (4 data-parallel ranks), fixed-size micro-batches
    (no token budget), a GQA model whose 2 kv heads are fewer than the group (repeated), under FSDP2 in fp64."""
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    parallel = "ddp" if fsdp2_problem(torch.float64) else "fsdp2"
    model = _gqa_model(tmp_path / "gqa")
    fixed = [a for a in RUN if not a.startswith(("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu",
                                                  "trainer.nproc_per_node", "actor.ppo_mini_batch_size",
                                                  "data.train_batch_size"))]
    extra = ["trainer.nproc_per_node=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=8",
             f"model.path={model}"]

    def run(out: Path, sp: int) -> list[dict]:
        cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(out), *fixed,
               *extra, f"trainer.parallel={parallel}", f"actor.ulysses_sequence_parallel_size={sp}"]
        res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900, cwd=out.parent)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    dp, sp = run(tmp_path / "dp", 1), run(tmp_path / "sp", 4)
    assert len(dp) == len(sp) == 2
    for a, b in zip(dp, sp):
        for key in ("loss_policy", "grad_norm", "kl", "entropy", "ppo_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-10, abs=1e-12), key

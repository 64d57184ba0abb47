"""Ulysses sequence parallelism on CPU ranks (gloo): a micro-batch's packed row split over 2 or 4 ranks gives the
one-rank log-probs, and the group's gradients add up to the one-rank gradient, to fp64 rounding, for dense heads and
for key/value heads fewer than the group (repeated), and for a vision-language policy in fp32
(tests/distributed/ulysses_worker.py).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.tolerances import tolerance

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_data_parallel import ENV  # noqa: E402


def errors(out: Path, ranks: int, *args: str, env=None, device="cpu", dtype="fp64") -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", str(ranks), str(HERE / "ulysses_worker.py"),
           str(out), device, dtype, *args]
    res = subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((out / f"errors_rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks,sp,kv_heads,dtype", [
    (2, 2, "4", torch.float64),  # dense: 4 heads, 2 each
    (4, 4, "2", torch.float64),  # GQA with 2 kv heads over 4 ranks: each repeated twice
    (2, 2, "vl", torch.float32),  # the tiny Qwen2.5-VL: its vision tower on every rank, the split after it
], ids=["sp2-dense", "sp4-gqa2", "sp2-vision-language"])  # one kv head, offload: tests/emulated/test_ulysses_devices.py
def test_sequence_parallel_gradients_equal_one_rank(tmp_path, ranks, sp, kv_heads, dtype):
    if kv_heads == "vl":
        pytest.importorskip("PIL")
        from portagrpo.model.vision import vision_support_problem

        if vision_support_problem():
            pytest.skip(vision_support_problem())
    name = {torch.float64: "fp64", torch.float32: "fp32"}[dtype]
    for rank_errors in errors(tmp_path, ranks, str(sp), kv_heads, dtype=name):
        # a scoring pass: each rank brings other rows, the group scores their union, each keeps its own
        assert rank_errors.pop("scoring") <= tolerance(dtype, "logprob")
        worst = max(rank_errors, key=rank_errors.get)
        assert rank_errors["logp"] <= tolerance(dtype, "logprob"), rank_errors["logp"]
        assert rank_errors[worst] <= tolerance(dtype, "grad"), (worst, rank_errors[worst])


def test_heads_the_group_cannot_split_are_one_sentence():
    from portagrpo.model.ulysses import check_heads

    assert check_heads(8, 2, 4) is None and check_heads(8, 8, 4) is None and check_heads(8, 1, 8) is None
    assert "must divide the model's 6 attention heads" in check_heads(6, 6, 4)
    assert "one must divide the other" in check_heads(12, 3, 2)


def test_verls_long_context_keys_map_to_real_settings():
    from portagrpo.config.verl import translate

    ar = "actor_rollout_ref."
    out, notices, rejected = translate([(ar + "actor.ulysses_sequence_parallel_size", "2"),
                                        (ar + "model.use_remove_padding", "True"),
                                        (ar + "model.enable_activation_offload", "True")])
    assert dict(out) == {"actor.ulysses_sequence_parallel_size": "2", "model.use_remove_padding": "True",
                         "model.enable_activation_offload": "True"} and not rejected
    assert not any("no effect" in n for n in notices)


def test_a_packed_row_plan_splits_response_tokens_by_shard():
    from portagrpo.model.ulysses import SequenceGroup, plan_row

    row = plan_row([(3, 4), (2, 1)], SequenceGroup(None, 4, 1))  # 10 tokens padded to 12, shards of 3
    assert row.seqlens == (7, 3, 2) and (row.start, row.stop) == (3, 6)
    assert row.predicting == [2, 3, 4, 5, 8] and row.counts == [1, 3, 1, 0] and row.mine == (1, 4)


def test_a_group_size_the_ranks_cannot_take_is_one_sentence():
    from portagrpo.config import load_config
    from portagrpo.config.rules import validate_world

    sp = "actor.ulysses_sequence_parallel_size"
    assert validate_world(load_config(None, [f"{sp}=2"]), 4) == []
    assert "must divide the 4 rank(s)" in validate_world(load_config(None, [f"{sp}=3"]), 4)[0]
    assert "model.use_remove_padding=true" in validate_world(
        load_config(None, [f"{sp}=2", "model.use_remove_padding=false"]), 4)[0]


def test_a_mixture_of_experts_policy_under_sequence_parallelism_is_one_sentence():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from portagrpo.errors import UserError
    from portagrpo.kernels import logprob_impl
    from portagrpo.model.scorer import ResponseScorer
    from portagrpo.model.ulysses import SequenceGroup

    config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=2,
                            num_experts_per_tok=1, attn_implementation="sdpa")
    with pytest.raises(UserError, match="mixture-of-experts policy's routes"):
        ResponseScorer(Qwen3MoeForCausalLM(config), logprob_impl("reference"),
                       sequence_parallel=SequenceGroup(None, 2, 0))

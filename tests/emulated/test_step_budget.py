"""What a training step costs an accelerator, counted on the emulated device (portagrpo_emu.counters):
host synchronisations inside the micro-batch loops, the dtype of the LM-head matmuls under bf16
autocast, gradient reduce-scatters under FSDP2 and all-gathers in the weight push. The CPU pays
nothing for any of these, so only the emulated device can see them. Each budget failed on the code
before the fix it guards (issue 23, part 3)."""
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_emulated_device import ENV, HERE, pytestmark  # noqa: E402,F401 - the same skip rule

# Two steps, 16 responses, mini-batches of 8: two optimizer steps per training step; bf16 autocast
# over fp32 master weights (`model.dtype=bf16`).
STEP = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.ppo_epochs=1", "model.dtype=bf16", "reward.num_workers=0"]
OPTIMIZER_STEPS = 2


def counted_run(out: Path, *overrides: str) -> tuple[list[list[dict]], dict]:
    """Train on emu with counters on; the spans of every rank (rank 0 first) and the model's config."""
    counts = out.parent / f"{out.name}.counters.json"
    res = subprocess.run([sys.executable, "-m", "portagrpo", "train", "--device", "emu", "--output-dir", str(out),
                          *STEP, *overrides], env={**ENV, "PORTAGRPO_EMU_COUNTERS": str(counts)},
                         capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    ranks = [json.loads(counts.read_text())]
    ranks += [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{counts.name}.rank*"))]
    return ranks, json.loads((out / "init_model" / "config.json").read_text())


def last_step(spans: list[dict], label: str) -> dict:
    """The span `label` of the last training step (the first step also warms caches up)."""
    return [s for s in spans if s["label"] == label][-1]


def syncs(span: dict) -> int:
    return sum(span["host_syncs"].values())


def lm_head_matmuls(span: dict, vocab: int) -> Counter:
    return Counter({k: v for k, v in span["matmuls"].items() if k.endswith(f"->{vocab}")})


def assert_bf16_lm_head(spans: list[dict], vocab: int) -> None:
    for label in ("logprobs", "update"):
        heads = lm_head_matmuls(last_step(spans, label), vocab)
        assert heads and all("(bfloat16,bfloat16)" in k for k in heads), (label, dict(heads))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    base = tmp_path_factory.mktemp("budget")
    return {mb: counted_run(base / f"mb{mb}", f"actor.micro_batch_size={mb}") for mb in (2, 8)}


def test_no_host_sync_inside_the_micro_batch_loops(single):
    """Scoring waits for the device never; the update once per optimizer step (is the gradient norm
    finite?) and once for the step's metrics. Four times as many micro-batches change nothing."""
    for mb, (ranks, _) in single.items():
        spans = ranks[0]
        assert syncs(last_step(spans, "logprobs")) == 0, (mb, last_step(spans, "logprobs")["host_syncs"])
        update = last_step(spans, "update")
        assert syncs(update) == OPTIMIZER_STEPS + 1, (mb, update["host_syncs"])


def test_lm_head_is_bf16_under_autocast_on_one_device(single):
    for ranks, config in single.values():
        assert_bf16_lm_head(ranks[0], config["vocab_size"])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_keep_the_budget(tmp_path, parallel):
    """Both ranks: no host sync in scoring, bf16 LM heads; under FSDP2 one gradient reduce-scatter per
    FSDP unit (the decoder layers and the root, which together hold every parameter once) per micro-batch
    (each rank's mini-batch runs as two): the lean default, which keeps only gradient shards
    (tests/emulated/test_grad_memory.py has the deferred switch)."""
    ranks, config = counted_run(tmp_path / "run", "trainer.nproc_per_node=2", f"trainer.parallel={parallel}",
                                "actor.micro_batch_size=2")
    assert len(ranks) == 2
    for spans in ranks:
        assert syncs(last_step(spans, "logprobs")) == 0, last_step(spans, "logprobs")["host_syncs"]
        assert_bf16_lm_head(spans, config["vocab_size"])
        update = last_step(spans, "update")["collectives"]
        if parallel == "fsdp2":
            assert update["reduce_scatter"] == (config["num_hidden_layers"] + 1) * OPTIMIZER_STEPS * 2, update
        else:  # one all-reduce of the token counts and one of the flat gradients per optimizer step
            assert update["all_reduce"] == 2 * OPTIMIZER_STEPS and "reduce_scatter" not in update, update


def test_weight_push_never_gathers_a_tied_lm_head(tmp_path):
    """Under FSDP2 the push gathers each parameter once: the tied `lm_head` (the embedding itself) is
    not gathered a second time only for the engine to drop it."""
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "push_check.py")]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "lm_head.weight" not in out["names"] and "model.embed_tokens.weight" in out["names"]
    assert out["all_gathers"] == out["parameters"] == len(out["names"]), out

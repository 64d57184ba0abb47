"""A tiny Qwen3-MoE and a tiny Qwen2-MoE (its shared expert besides the routed ones) through the CLI on one process
with router replay R3 (hf engine): the sampler's and trainer's log-probs agree to fp32 rounding every step and the
route agreement is logged; a resume repeats the run exactly; the recorded rollouts carry their routes and `portagrpo
replay` repeats the run exactly; the exported checkpoint loads in plain transformers with the experts of the trained
policy."""
import json

import pytest
import torch

from portagrpo.cli import main
from portagrpo.metrics import MEASURED_KEYS, read_metrics

FAST = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "data.train_batch_size=4",
        "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "data.train_size=32",
        "data.max_response_length=12", "trainer.test_freq=0", "actor.router_replay=R3"]
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(CLASSES, reverse=True))
def run(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(request.param) / "run"
    family = f"model.tiny.moe={request.param}"
    assert main(["train", "--output-dir", str(out), "trainer.total_steps=2", "trainer.save_freq=1",
                 "trainer.record_rollouts=true", *FAST, family]) == 0
    return out, family


def test_r3_keeps_sampler_and_trainer_equal_and_logs_the_route_agreement(run):
    run, _ = run
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert abs(r["rollout_corr/kl"]) < 1e-6 and r["rollout_corr/abs_logp_diff_max"] < 1e-5, r
        assert 0.5 < r["moe/route_agreement"] <= 1.0
    record = torch.load(run / "rollouts" / "step_00000002.pt", weights_only=False)
    routes = record["routes"]
    assert routes.dtype == torch.int16 and routes.shape[0] == 16 and routes.shape[2:] == (2, 2)
    assert routes.shape[1] == record["prompt_ids"].shape[1] + record["responses"].shape[1]
    prompt_cols = record["prompt_mask"].bool()
    assert (routes[:, :prompt_cols.shape[1]][prompt_cols] >= 0).all()  # every real prompt token was routed


def test_resume_continues_exactly(run, tmp_path):
    run, family = run
    part = tmp_path / "part"
    assert main(["train", "--output-dir", str(part), "trainer.total_steps=1", "trainer.save_freq=1", *FAST,
                 family]) == 0
    assert main(["train", "--output-dir", str(part), "--resume", str(part), "trainer.total_steps=2",
                 "trainer.save_freq=1", *FAST, family]) == 0
    want, got = read_metrics(run / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    for a, b in zip(want, got):
        assert {k: v for k, v in a.items() if k not in MEASURED_KEYS} == \
               {k: v for k, v in b.items() if k not in MEASURED_KEYS}


def test_replay_of_an_r3_run_is_exact(run, tmp_path, capsys):
    run, _ = run
    out = tmp_path / "replay"
    assert main(["replay", str(run), "--device", "cpu", "--output-dir", str(out)]) == 0
    assert "replay matches the recorded run" in capsys.readouterr().out
    report = json.loads((out / "replay.json").read_text())
    assert report["passed"] and len(report["steps"]) == 2
    for step in report["steps"]:  # the same device: every number repeats bit for bit
        assert step["param_drift"] == 0.0, step
        assert all(v["recorded"] == v["replayed"] for v in step.values() if isinstance(v, dict)), step


def test_export_loads_in_plain_transformers(run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, family = run
    out = tmp_path / "export"
    assert main(["export", str(run), "--output", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == CLASSES[family.split("=")[1]]
    saved = {}
    for f in out.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    # a hub checkpoint's per-expert names, and the trained values behind them
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved
    ckpt = run / "checkpoints" / "step_00000002" / "model"
    trained = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    for (name, a), b in zip(model.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_router_replay_with_gradient_checkpointing_trains_as_without_it(tmp_path, mode):
    """The Qwen3-30B-A3B recipes' setting (R2, gradient checkpointing) with a scoring pass (two epochs): checkpointed
    layers recompute with the routes their forward replayed, so the run is the one without checkpointing to fp32
    rounding, route agreement included. Before, the first off-policy update stopped in torch's checkpoint check."""
    args = [*FAST, "model.tiny.moe=qwen3_moe", "trainer.total_steps=2", "actor.ppo_epochs=2", "actor.lr=1e-2",
            "rollout.mode=one_step_off", f"actor.router_replay={mode}"]
    rows = {}
    for gc in (False, True):
        out = tmp_path / f"gc{gc}"
        assert main(["train", "--output-dir", str(out), *args, f"model.gradient_checkpointing={str(gc).lower()}"]) == 0
        rows[gc] = read_metrics(out / "metrics.jsonl")
    for plain, checkpointed in zip(rows[False], rows[True]):
        assert checkpointed["moe/route_agreement"] == plain["moe/route_agreement"]
        for key in ("loss_policy", "grad_norm"):
            assert abs(checkpointed[key] - plain[key]) <= 1e-5 * max(1.0, abs(plain[key])), (key, plain, checkpointed)

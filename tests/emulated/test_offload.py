"""FSDP2 offload (actor.offload, actor.ref_offload) on 2 emulated ranks, whose device counts its bytes: the shards,
their gradients and the optimizer state leave the device, which then holds only what a unit's forward or backward
needs, and the numbers trained do not change."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_emulated_device import ENV, pytestmark  # noqa: F401 - the same skip rule

RUN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=2",
       "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "trainer.parallel=fsdp2", "rollout.engine=fixed",
       "trainer.nproc_per_node=2", "model.tiny.hidden_size=256", "model.tiny.num_layers=4",
       "model.tiny.intermediate_size=1024"]


def _train(out, offload: bool, *extra: str) -> list[dict]:
    flag = str(offload).lower()
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "emu", "--output-dir", str(out), *RUN,
           f"actor.offload={flag}", f"actor.ref_offload={flag}", *extra]
    res = subprocess.run(cmd, env={**ENV, "PORTAGRPO_EMU_DEVICES": "1"}, capture_output=True, text=True, timeout=1200,
                         cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_offload_moves_the_states_off_the_device_and_changes_no_number(tmp_path):
    on, off = _train(tmp_path / "on", True), _train(tmp_path / "off", False)
    assert on[0]["mem/load_peak_gb"] < 0.01 * off[0]["mem/load_peak_gb"]  # both models' shards in host memory
    for a, b in zip(on, off):
        assert a["mem/update_peak_gb"] <= 0.5 * b["mem/update_peak_gb"]  # no optimizer state, no gradient shards
        for key in ("loss_policy", "grad_norm", "kl", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_one_rank_offloads_through_fsdp2_over_a_group_of_one(tmp_path):
    """One device (a single-GPU machine): actor.offload runs FSDP2 over a process group of one rank, its states in
    host memory, with the numbers of a plain one-process run (trainer.parallel=auto: ddp here, so none)."""
    one = ("trainer.nproc_per_node=1",)
    on = _train(tmp_path / "on", True, *one, "trainer.parallel=fsdp2")
    plain = _train(tmp_path / "plain", False, *one, "trainer.parallel=auto")
    assert on[0]["mem/load_peak_gb"] < 0.01 * plain[0]["mem/load_peak_gb"]
    for a, b in zip(on, plain):
        assert a["mem/update_peak_gb"] <= 0.5 * b["mem/update_peak_gb"]
        for key in ("loss_policy", "grad_norm", "kl", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_verls_offload_keys_are_honoured():
    from portagrpo.config.verl import translate

    ar = "actor_rollout_ref."
    out, notices, rejected = translate([(ar + "actor.fsdp_config.param_offload", "True"),
                                        (ar + "actor.fsdp_config.optimizer_offload", "True"),
                                        (ar + "ref.fsdp_config.param_offload", "True")])
    assert ("actor.offload", True) in out and ("actor.ref_offload", True) in out and not rejected
    assert not any("no effect" in n for n in notices)
    out, _, _ = translate([(ar + "actor.fsdp_config.param_offload", "False")])
    assert out == [("actor.offload", False)]


def test_rolls_deepspeed_offload_is_honoured():
    from portagrpo.config.roll import translate

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    ref_zero = {"offload_param": {"device": "cpu"}}
    raw = {"pretrain": "m", "actor_train": {"strategy_args": {"strategy_config": {"zero_optimization": zero}}},
           "reference": {"strategy_args": {"strategy_config": {"zero_optimization": ref_zero}}}}
    out, _, problems = translate(raw)
    assert out["actor.offload"] is True and out["actor.ref_offload"] is True and not problems
    raw["actor_train"]["strategy_args"]["strategy_config"]["zero_optimization"] = {"stage": 3}
    out, _, _ = translate(raw)
    assert "actor.offload" not in out


def _offload_check(tmp_path, device: str, form: str) -> dict:
    from npu_sim_env import npu_sim_env

    env = npu_sim_env(tmp_path) if device == "npu" else {**ENV, "PORTAGRPO_EMU_DEVICES": "1"}
    script = Path(__file__).resolve().parent / "offload_check.py"
    tmp_path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(script), device, form],
                         env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("device", ["emu", "npu"])
def test_offloaded_shards_reduce_and_push_over_the_group_as_a_run_forms_it(tmp_path, device):
    """issue 50: with the library alone (nccl, hccl), torch gives the group no CPU backend, and the host gradients'
    norm fails with torch's own words on the strict stand-ins; as portagrpo forms the group (cpu:gloo,<device>:
    <library>, verl's form) the norm, the host AdamW step and the push's gather all run."""
    before = _offload_check(tmp_path / "library", device, "library")
    assert before["host_shards"] is True and before["steps"] == ["backward"], before
    assert "No backend type associated with device type cpu" in before["error"], before
    after = _offload_check(tmp_path / "run", device, "run")
    assert "cpu:gloo" in after["form"] and "error" not in after, after
    # the trained pass gathers the head whose shards live on the host; the pass without gradients streams them
    assert after["gathered_passes"] == [True] and after["no_grad_same"], after
    assert after["steps"] == ["backward", "clip_grad_norm", "step", "push"] and after["grad_norm"] > 0
    assert after["pushed"] == 21 and after["push_devices"] == [device]  # gathered on the device, as torch does

"""The trainer's features with `rollout.engine=vllm` against a real vLLM (the CPU build), each through `portagrpo
train` as a user runs it: record and replay, token TIS and bypass mode (both weigh the loss with the log-probs vLLM
reports), DAPO's filter_groups (more sampling rounds without a push in between), two training ranks with an engine
each, and reward rising on the embedded task (`rollout.mode=one_step_off` with vLLM: test_one_step_off_vllm.py).

Every run is checked to have sampled with vLLM itself: its log names the engine vLLM built (`Initializing a V1 LLM
engine (vX)`, once per engine, with the installed version), which the stand-in (tests/standins/fake_vllm.py) never
prints; it is not importable in these subprocesses anyway. Runs are few and short (the leg's time is budgeted):
one run serves several tests where the features can share it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.tolerances import tolerance

pytestmark = pytest.mark.real_vllm
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8",
         "data.train_size=32", "data.val_size=8", "data.max_response_length=8", "trainer.test_freq=0"]
ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\) with config: .*?tensor_parallel_size=(\d+)")


def _run(*args: str) -> subprocess.CompletedProcess:
    # vLLM's INFO lines name the engines it built (_assert_real_vllm reads them)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="INFO")
    return subprocess.run([sys.executable, "-m", "portagrpo", *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)


def _train(run_dir: Path, *overrides: str) -> tuple[list[dict], str]:
    """`portagrpo train` with vLLM: the metrics rows and the run's output (vLLM logs to stdout)."""
    from portagrpo.metrics import read_metrics

    res = _run("train", "--device", "cpu", "--output-dir", str(run_dir), "trainer.progress_bar=false",
               "rollout.engine=vllm", *overrides)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return read_metrics(run_dir / "metrics.jsonl"), res.stdout + res.stderr


def _assert_real_vllm(log: str, engines: int = 1, tp: int = 1) -> None:
    """The run built `engines` engines of real vLLM (the installed version), each with this tensor-parallel size."""
    from portagrpo.rollout.vllm import installed_vllm

    built = ENGINE_LINE.findall(log)
    assert len(built) == engines, f"expected {engines} vLLM engine(s) built, the log shows {built}"
    assert all(v == installed_vllm() and int(size) == tp for v, size in built), built


def _sampler_matches_trainer(row: dict) -> None:
    assert abs(row["rollout_corr/kl"]) <= tolerance(torch.float32, "kl"), row
    assert row["rollout_corr/abs_logp_diff_max"] <= 1e-4, row


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, qwen2_dir):
    """Two recorded steps with token TIS, sampled at temperature 0.7: vLLM's processed log-probs are the ones drawn
    with, so the importance weights are 1 to fp32 rounding (raw ones would not be). No top-k/top-p here: the trainer
    scores the untruncated distribution, so truncation is a real mismatch that TIS weighs, not rounding."""
    run = tmp_path_factory.mktemp("recorded") / "run"
    rows, log = _train(run, *SMALL, f"model.path={qwen2_dir}", "trainer.total_steps=2", "trainer.record_rollouts=true",
                       "algorithm.rollout_correction.rollout_is=token", "rollout.temperature=0.7")
    _assert_real_vllm(log)
    return run, rows


def test_token_tis_weighs_the_loss_with_vllms_logprobs(recorded):
    _, rows = recorded
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        _sampler_matches_trainer(row)
        for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min", "rollout_corr/rollout_is_max"):
            assert row[key] == pytest.approx(1.0, abs=1e-5), (key, row)
        assert row["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0, row  # no weight truncated


def test_a_vllm_run_replays(recorded, tmp_path):
    """`portagrpo replay` re-trains on the rollouts vLLM drew (its log-probs included, which TIS reads) and
    reproduces the recorded run's losses and parameters."""
    run, _ = recorded
    assert len(sorted((run / "rollouts").glob("step_*.pt"))) == 2
    res = _run("replay", str(run), "--device", "cpu", "--output-dir", str(tmp_path / "replay"))
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert "replay matches the recorded run" in res.stdout, res.stdout[-3000:]


@pytest.fixture(scope="module")
def filtered_bypass(tmp_path_factory, qwen2_dir):
    """DAPO's dynamic sampling with bypass mode, at temperature 0.15: cold enough that some groups' samples all
    score alike and are dropped (more rounds, sampled without a push in between), and far enough from 1 that
    raw log-probs would differ from the processed ones the bypass ratio needs."""
    run = tmp_path_factory.mktemp("dapo") / "run"
    rows, log = _train(run, *SMALL, f"model.path={qwen2_dir}", "trainer.total_steps=3", "rollout.temperature=0.15",
                       "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                       "algorithm.filter_groups.max_num_gen_batches=20",
                       "algorithm.rollout_correction.bypass_mode=true")
    _assert_real_vllm(log)
    return rows


def test_dapo_filter_groups_samples_more_rounds_with_vllm(filtered_bypass):
    rows = filtered_bypass
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["gen_rounds"] for r in rows) > len(rows), [r["gen_rounds"] for r in rows]  # groups were dropped
    for row in rows:
        assert row["zero_std_group_frac"] == 0.0, row  # every kept group has a spread
        _sampler_matches_trainer(row)  # the extra rounds sampled from the pushed weights too


def test_bypass_mode_takes_vllms_logprobs_as_the_old_ones(filtered_bypass):
    """In bypass mode the sampler's log-probs are the old ones: with one mini-batch per step the PPO ratio is
    pi_train / pi_vLLM, which is 1 when vLLM reports the log-probs it drew with."""
    for row in filtered_bypass:
        assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5), row
        assert row["clipfrac"] == 0.0 and abs(row["ppo_kl"]) <= tolerance(torch.float32, "kl"), row


def test_two_training_ranks_each_with_its_own_engine(tmp_path, qwen2_dir):
    rows, log = _train(tmp_path / "run", *SMALL, f"model.path={qwen2_dir}", "trainer.total_steps=2",
                       "trainer.nproc_per_node=2")
    _assert_real_vllm(log, engines=2, tp=1)
    pids = set(re.findall(r"\(\w+ pid=(\d+)\) INFO [^\n]*Initializing a V1 LLM engine", log))
    assert len(pids) == 2, pids  # one engine in each rank's process
    assert [(r["step"], r["world_size"]) for r in rows] == [(1, 2), (2, 2)]
    for row in rows:
        _sampler_matches_trainer(row)


def test_reward_rises_on_the_embedded_task_with_vllm(tmp_path):
    """The default run (16 prompts x 8 samples) on the built-in model, with no model setting: in 20 steps the policy
    learns to answer in digits, mean reward ~0.03 -> ~0.3; with the sampler's log-probs at fp32 rounding of the
    trainer's every step."""
    rows, log = _train(tmp_path / "run", "trainer.total_steps=20", "trainer.test_freq=0")
    _assert_real_vllm(log)
    first = sum(r["reward_mean"] for r in rows[:2]) / 2
    last = sum(r["reward_mean"] for r in rows[-2:]) / 2
    assert last - first >= 0.15, [round(r["reward_mean"], 3) for r in rows]
    for row in rows:
        _sampler_matches_trainer(row)



def test_a_bf16_sampler_for_an_fp32_policy(tmp_path, qwen2_dir):
    """rollout.precision=bf16 with an fp32 policy (verl's rollout dtype): vLLM is built in bfloat16 and every push
    casts the policy's weights into it, so the sampler's log-probs differ from the trainer's by bf16 rounding (an
    fp32 sampler matches to 1e-4: the tests above), a gap token TIS weighs; the push still carries every update
    (the gap stays at rounding on step 2)."""
    rows, log = _train(tmp_path / "run", *SMALL, f"model.path={qwen2_dir}", "trainer.total_steps=2",
                       "rollout.precision=bf16", "algorithm.rollout_correction.rollout_is=token")
    _assert_real_vllm(log)
    assert re.search(r"Initializing a V1 LLM engine [^\n]*dtype=torch\.bfloat16", log), "vLLM was not built in bf16"
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 1e-3 < row["rollout_corr/abs_logp_diff_max"] < 0.5, row
        assert abs(row["rollout_corr/kl"]) < 0.01, row
        assert row["rollout_corr/rollout_is_mean"] != 1.0 and abs(row["rollout_corr/rollout_is_mean"] - 1) < 0.05, row

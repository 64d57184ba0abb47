"""`rollout.mode=one_step_off` with `rollout.engine=vllm` against a real vLLM (the CPU build): each rank's sampler
process holds a vLLM engine built from the run's initial model, receives the weights after every update, and samples
batch k+1 (with the request's seed) while the trainer updates on batch k, returning vLLM's processed log-probs.

In the process's own terms (the trainer drives its sampler process directly): its log-probs equal the trainer's in
fp32 for the weights it holds (the initial model, then each push), differ after an update that was not pushed, and a
request's seed fixes its tokens. Through `portagrpo train`: every batch after the first is one update stale, the
`rollout_corr/*` metrics measure it, and a run resumed from a checkpoint continues as the uninterrupted one did.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.tolerances import assert_close, relative_error, tolerance

pytestmark = pytest.mark.real_vllm
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8",
         "data.train_size=32", "data.val_size=8", "data.max_response_length=8", "trainer.test_freq=0"]
TEMPERATURE = 0.7
# vLLM names the engine it builds (once per engine); the sampler process's lines carry its process name
SAMPLER_ENGINE = re.compile(r"\(portagrpo-sampler pid=\d+\) INFO [^\n]*Initializing a V1 LLM engine \(v([^)]+)\)")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, qwen2_dir):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", "rollout.mode=one_step_off", f"model.path={qwen2_dir}",
                             f"rollout.temperature={TEMPERATURE}", *SMALL])
    t = Trainer(cfg, run_dir=tmp_path_factory.mktemp("run"), log=lambda m: None).setup()
    yield t
    t.close()


def _ask(t, records, seed: int):
    """One round of the sampler process, as the one_step_off schedule asks for it; the rows it answered."""
    p, sampler = t.pipeline, t.parts.sampler
    request = p.request(1, 0, records)
    sampler.submit(request.prompts, 4, SamplingParams(8, TEMPERATURE), request.width, seed)
    return sampler.result().rollout.to(p.runtime.device)


def _gap(t, records, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampler's, trainer's) log-probs of the sampled response tokens."""
    rb = _ask(t, records, seed)
    ours, _ = t.pipeline.logprobs.logprobs(t.models.scorer, rb, entropy=False)
    mask = rb.response_mask.bool()
    assert rb.rollout_logp is not None and mask.any()
    return rb.rollout_logp[mask], ours[mask].float()


def test_the_sampler_process_samples_from_the_weights_it_was_given(trainer):
    """Built from the run's initial model, its processed log-probs equal the trainer's; an update that is not
    pushed shows (else a push that does nothing would pass); pushing it closes the gap again."""
    from portagrpo.train.build import push_weights

    t = trainer
    assert t.parts.sampler.process.pid != os.getpid() and t.parts.engine.holds_weights is False  # hf validates here
    records = t.parts.data.loader.next_batch()
    sampler, ours = _gap(t, records)
    assert_close(sampler, ours, torch.float32, "logprob", "sampler process vs trainer on the initial model")

    with torch.no_grad():  # an update the sampler is not told about
        g = torch.Generator().manual_seed(0)
        for p in t.models.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    sampler, ours = _gap(t, records)
    gap = relative_error(sampler, ours)
    assert gap > 100 * tolerance(torch.float32, "logprob"), f"sampled from the unpushed weights (gap {gap:.2e})"

    push_weights(t.parts.sampler, t.models)
    sampler, ours = _gap(t, records)
    assert_close(sampler, ours, torch.float32, "logprob", "sampler process vs trainer after a push")


def test_a_requests_seed_fixes_its_tokens(trainer):
    records = trainer.parts.data.loader.next_batch()
    first, again, other = (_ask(trainer, records, seed).responses for seed in (5, 5, 6))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def _train(run_dir: Path, *overrides: str, resume: Path | None = None) -> tuple[list[dict], str]:
    from portagrpo.metrics import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="INFO")
    res = subprocess.run([sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(run_dir),
                          *(["--resume", str(resume)] if resume else []), "trainer.progress_bar=false",
                          "rollout.engine=vllm", "rollout.mode=one_step_off", *SMALL, *overrides],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return read_metrics(run_dir / "metrics.jsonl"), res.stdout + res.stderr


def test_one_step_off_with_vllm_trains_one_update_stale_and_resumes(tmp_path, qwen2_dir):
    """Four steps, a checkpoint at step 2. vLLM is built once, in the sampler process. Batch 1 is sampled from the
    initial weights the trainer scores it with (the sampler's log-probs at fp32 rounding of the trainer's); every
    later batch from the weights one update back (`rollout_staleness` 1), which `rollout_corr/*` measure: with
    updates that move the policy, more than rounding. Resumed from step 2, steps 3 and 4 repeat: the batch in
    flight at the save comes from the checkpoint, and the resumed sampler gets the step-2 weights."""
    from portagrpo.metrics import MEASURED_KEYS
    from portagrpo.rollout.vllm import installed_vllm

    run = tmp_path / "run"
    args = (f"model.path={qwen2_dir}", f"rollout.temperature={TEMPERATURE}", "actor.warmup_steps=0", "actor.lr=1e-3",
            "trainer.total_steps=4", "trainer.save_freq=2", "trainer.plot=false", "trainer.tensorboard=false")
    rows, log = _train(run, *args)
    assert SAMPLER_ENGINE.findall(log) == [installed_vllm()], "vLLM is built once, in the sampler process"
    assert "Initializing a V1 LLM engine" not in re.sub(SAMPLER_ENGINE, "", log)  # and not in the trainer's
    assert [(r["step"], r["rollout_staleness"]) for r in rows] == [(1, 0), (2, 1), (3, 1), (4, 1)]
    for row in rows:
        assert all(torch.isfinite(torch.tensor(row[k])) for k in ("rollout_corr/kl", "rollout_corr/abs_logp_diff_max",
                                                                   "rollout_corr/ppl_ratio")), row
    first = rows[0]
    assert abs(first["rollout_corr/kl"]) <= tolerance(torch.float32, "kl"), first
    assert first["rollout_corr/abs_logp_diff_max"] <= 1e-4, first
    assert max(r["rollout_corr/abs_logp_diff_max"] for r in rows[2:]) > 1e-3, rows  # one update stale shows

    copy = tmp_path / "again"  # a run resumes in its own directory
    shutil.copytree(run, copy)
    again, _ = _train(copy, *args, resume=copy / "checkpoints" / "step_00000002")
    again = [r for r in again if r["step"] > 2]
    assert [r["step"] for r in again] == [3, 4]
    for before, after in zip(rows[2:], again):
        for key, value in before.items():
            if key in MEASURED_KEYS or key.startswith("mem/"):  # memory is measured (a checkpoint's: the step after)
                continue
            if isinstance(value, float):
                assert after[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, before["step"])
            else:
                assert after[key] == value, (key, before["step"])

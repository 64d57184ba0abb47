"""An on-policy step (one epoch, one mini-batch) with the rollout correction's importance weights runs no scoring pass:
the weights and the `rollout_corr/*` metrics come from the update's own first forward, as TRL takes them (issue 42
item 5). The numbers equal those of the scoring pass it replaces, to fp32 rounding."""
import math

import pytest

import portagrpo.train.experience as experience

RUN = ["trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "data.train_batch_size=4",
       "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "actor.logprob_micro_batch_size=4",
       "data.train_size=32", "reward.num_workers=0", "trainer.num_threads=1", "actor.warmup_steps=0",
       "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.002",
       "rollout.precision=bf16"]  # a bf16 sampler copy, so the weights differ from 1, some truncated


def _steps(tmp_path, monkeypatch, scoring_pass: bool) -> tuple[list[dict], list]:
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    if scoring_pass:  # the rule before: a correction kept the scoring pass on an on-policy step
        monkeypatch.setattr(experience, "is_on_policy", lambda cfg, stale: False)
    t = Trainer(load_config(None, RUN), run_dir=tmp_path / ("before" if scoring_pass else "now"),
                log=lambda m: None).setup()
    passes = []
    real = t.pipeline.logprobs.passes
    monkeypatch.setattr(t.pipeline.logprobs, "passes", lambda scorer, *a, **k: passes.append(scorer) or real(
        scorer, *a, **k))
    try:
        assert t.experience.settings.scoring_pass == scoring_pass
        return [t.step().metrics.row() for _ in range(2)], [p is t.models.scorer for p in passes]
    finally:
        t.close()


def test_an_on_policy_corrected_step_takes_its_weights_from_the_update_and_matches_the_scoring_pass(
        tmp_path, monkeypatch):
    now, passes_now = _steps(tmp_path, monkeypatch, scoring_pass=False)
    assert not any(passes_now)  # no separate pass of the policy (the reference model's, with a KL loss, stays)
    with monkeypatch.context() as m:
        before, passes_before = _steps(tmp_path, m, scoring_pass=True)
    assert passes_before.count(True) == 2  # one scoring pass a step
    for a, b in zip(before, now):
        assert a["rollout_corr/abs_logp_diff_mean"] > 0 and a["rollout_corr/rollout_is_mean"] != 1.0  # it weighs
        for key, value in a.items():
            if key.startswith(("rollout_corr/", "loss_", "grad_norm", "entropy", "clipfrac", "ratio_mean", "kl",
                               "reward_mean", "adv_")):
                assert math.isfinite(b[key]) and b[key] == pytest.approx(value, rel=2e-5, abs=2e-6), key

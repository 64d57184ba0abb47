"""Rollout correction against verl 0.9.1's own outputs (tests/fixtures/verl_rollout_corr.pt, written by
tests/fixtures/make_verl_rollout_corr.py with verl installed), on random and adversarial inputs: huge
ratios, an all-masked row, single-token responses, NaN in the padding."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from portagrpo.algo.rollout_correction import (
    GAP_KEYS,
    PREFIX,
    RS_OPTIONS,
    RolloutCorrection,
    correct_rollout,
    gap_metrics,
    gap_report,
    is_weights,
    refusal,
    rejection_mask,
)
from portagrpo.config import ConfigError, correction_bounds, load_config
from portagrpo.train.experience import host_metrics

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verl_rollout_corr.pt"
CASES = torch.load(FIXTURE, weights_only=False)["cases"]


def _id(case) -> str:
    c = case["config"]
    return f"{case['input']}-is={c['rollout_is']}:{c['rollout_is_threshold']}:{c['rollout_is_batch_normalize']}" \
           f"-rs={c['rollout_rs']}:{c['rollout_rs_threshold']}"


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_the_fixture_covers_every_option_and_the_adversarial_inputs():
    assert torch.load(FIXTURE, weights_only=False)["verl_version"] == "0.9.1"
    inputs = {c["input"] for c in CASES}
    assert {"random", "huge_ratios", "all_masked_row", "single_token", "nan_padding"} <= inputs
    options = {o for c in CASES if c["config"]["rollout_rs"] for o in c["config"]["rollout_rs"].split(",")}
    assert len(options) == 11 and {c["config"]["rollout_is"] for c in CASES} == {None, "token", "sequence"}


def _spec(config: dict) -> RolloutCorrection:
    """verl's keys as the fixture holds them (strings and numbers), parsed by the config as a run parses them."""
    keys = [f"algorithm.rollout_correction.{k}={'null' if v is None else v}" for k, v in config.items()]
    threshold, rejection = correction_bounds(load_config(None, keys))
    return RolloutCorrection(rollout_is=config["rollout_is"], rollout_is_threshold=threshold,
                             rollout_is_batch_normalize=config["rollout_is_batch_normalize"], rollout_rs=rejection)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_weights_mask_and_metrics_equal_verl(case):
    spec = _spec(case["config"])
    weights, mask, metrics = correct_rollout(case["old"], case["rollout"], case["mask"], spec)
    metrics = {k: float(v) for k, v in metrics.items()}
    if "raises" in case:  # verl refuses these inputs (it divides by zero): so must we, once the metrics are read
        assert "widen the bounds" in (refusal(metrics, spec) or "")
        return
    assert refusal(metrics, spec) is None
    if case["weights"] is None:
        assert weights is None
    else:
        assert weights is not None and weights.requires_grad is False
        assert torch.allclose(weights, case["weights"], rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(mask, case["mask_out"]) and mask.dtype == case["mask"].dtype
    ours = {k: v for k, v in metrics.items() if k.removeprefix(PREFIX) not in GAP_KEYS}
    assert sorted(ours) == sorted(case["metrics"])
    wrong = {k: (ours[k], v) for k, v in case["metrics"].items() if not _close(ours[k], v)}
    assert not wrong


def test_rejection_never_touches_padding_and_a_sequence_option_drops_whole_rows():
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 5])[:, None]).float()
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    rollout = old.clone()
    rollout[1, 1] -= 4.0  # one token far off: seq_max_k2 rejects its whole row, token_k2 only that token
    seq, _ = rejection_mask(old - rollout, mask, (("seq_max_k2", None, 1.0),))
    tok, _ = rejection_mask(old - rollout, mask, (("token_k2", None, 1.0),))
    assert seq[1].sum() == 0 and torch.equal(seq[[0, 2, 3]], mask[[0, 2, 3]])
    assert tok[1].tolist() == [1, 0, 1, 0, 0, 0] and torch.equal(tok[[0, 2, 3]], mask[[0, 2, 3]])


def test_icepop_zeroes_outside_the_band_and_tis_only_truncates_above():
    log_ratio = torch.log(torch.tensor([[0.2, 0.8, 1.5, 9.0]], dtype=torch.float64))
    mask = torch.ones(1, 4, dtype=torch.float64)
    tis, _ = is_weights(log_ratio, mask, "token", 2.0)
    ice, _ = is_weights(log_ratio, mask, "token", (0.5, 5.0))
    assert torch.allclose(tis, torch.tensor([[0.2, 0.8, 1.5, 2.0]], dtype=torch.float64))
    assert torch.allclose(ice, torch.tensor([[0.0, 0.8, 1.5, 0.0]], dtype=torch.float64))


def test_gap_metrics_are_zero_for_identical_policies_and_grow_with_the_gap():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    same = {k: float(v) for k, v in gap_metrics(old, old, mask).items()}
    assert same == {"abs_logp_diff_mean": 0.0, "abs_logp_diff_max": 0.0, "eff_sample_size": pytest.approx(1.0)}
    off = {k: float(v) for k, v in gap_metrics(old, old + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64),
                                               mask).items()}
    assert off["abs_logp_diff_mean"] > 0.1 and off["eff_sample_size"] < 1.0


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("spec", ["0.5_2_3", "1_2_3", "nan", ".nan", "inf", ".inf", "1e999", "abc", "''", "2_1",
                                  "2_2", "0_1", "-1", "0", "0.5_", "_2", "0.5__2", "[1, 2]", "1e3_nan"])
def test_a_threshold_that_is_not_a_bound_is_one_sentence_naming_the_key(spec):
    """verl's "L_U": two finite positive numbers, L < U; Python's float() would read 0.5_2_3 as 0.523."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold={spec}"])
    (problem,) = info.value.problems
    assert problem.startswith(f"{RC}.rollout_is_threshold") and ("L < U" in problem or "must be str" in problem)
    with pytest.raises(ConfigError) as info:  # checked even while rollout_is is off: never silently malformed
        load_config(None, [f"{RC}.rollout_is_threshold={spec}"])
    assert len(info.value.problems) == 1


@pytest.mark.parametrize("rs,spec,part", [("token_k1", "0.5_2_3", "'0.5_2_3'"), ("token_k2", "0.5_2", "'0.5_2'"),
                                         ("seq_mean_k3", "nan", "'nan'"), ("token_k1", "0.5", "'0.5'"),
                                         ("token_k1,seq_max_k2", "0.5_2.0,1_0", "'1_0'"),
                                         ("token_k1,seq_max_k2", "2.0,", "''"), ("seq_sum_k1", "2_0.5", "'2_0.5'")])
def test_a_rejection_bound_that_is_not_one_is_one_sentence_naming_the_key(rs, spec, part):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{RC}.rollout_rs={rs}", f"{RC}.rollout_rs_threshold={spec}"])
    (problem,) = info.value.problems
    assert problem.startswith(f"{RC}.rollout_rs_threshold=") and f"the bound {part} for " in problem


def test_thresholds_reach_the_math_as_the_numbers_written():
    def bounds(*keys, config=None):
        return correction_bounds(load_config(config, [f"{RC}.rollout_is=token", *keys]))

    assert bounds() == (2.0, ())
    assert bounds(f"{RC}.rollout_is_threshold=1.5") == (1.5, ())
    assert bounds(f"{RC}.rollout_is_threshold=0.5_5") == ((0.5, 5.0), ())
    assert bounds(f"{RC}.rollout_is_threshold=1e-1_1e1") == ((0.1, 10.0), ())
    assert bounds(f"{RC}.rollout_rs=token_k1,seq_max_k2", f"{RC}.rollout_rs_threshold=4,0.5") == (
        2.0, (("token_k1", 0.25, 4.0), ("seq_max_k2", None, 0.5)))
    assert correction_bounds(load_config(None, []))[0] is None  # rollout_is off: no weights


def test_a_yaml_file_threshold_keeps_the_text_as_written(tmp_path):
    """YAML 1.1 reads 0.5_2 as the float 0.52 and 0.5_2_3 as 0.523; the threshold takes the text as written."""
    f = tmp_path / "c.yaml"
    f.write_text("algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 0.5_2\n")
    assert correction_bounds(load_config(f, []))[0] == (0.5, 2.0)
    f.write_text(f.read_text().replace("0.5_2", "0.5_2_3"))
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='0.5_2_3' must be a positive number"):
        load_config(f, [])
    f.write_text("actor:\n  lr: 1_0.0e-4\n  ppo_epochs: 1_0\n")  # number fields: YAML's number, as before
    cfg = load_config(f, [])
    assert cfg.actor.lr == pytest.approx(1e-3) and cfg.actor.ppo_epochs == 10


def test_the_math_takes_numbers_not_strings():
    log_ratio, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match="pass a number or a"):
        is_weights(log_ratio, mask, "token", "0.5_5.0")


def _every_option() -> RolloutCorrection:
    bounds = tuple((o, 0.5, 2.0) if o.endswith("k1") else (o, None, 2.0) for o in RS_OPTIONS)
    return RolloutCorrection(rollout_is="token", rollout_is_threshold=(0.5, 5.0), rollout_is_batch_normalize=True,
                             rollout_rs=bounds)


def test_every_metric_is_a_detached_0_dim_tensor():
    """The math returns tensors and leaves the host read to the caller (STYLE rule 1), whatever needs a gradient."""
    g = torch.Generator().manual_seed(7)
    old = (-torch.rand(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    rollout = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 0, 1, 4])[:, None]).double()  # an empty row among them
    for spec in (_every_option(), RolloutCorrection(rollout_is="sequence", rollout_is_threshold=2.0)):
        _, _, metrics = correct_rollout(old, rollout, mask, spec)
        for name, value in {**metrics, **gap_report(old, rollout, mask)}.items():
            assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad, name


def test_a_batch_without_a_valid_token_is_refused_once_read_not_while_computed():
    old, mask = -torch.rand(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)
    for spec in (_every_option(), RolloutCorrection(rollout_rs=(("token_k2", None, 1.0),))):
        _, loss_mask, metrics = correct_rollout(old, old - 0.1, mask, spec)
        assert loss_mask.sum() == 0
        assert refusal(host_metrics(metrics), spec) == "rollout correction needs at least one valid token."
    assert refusal(host_metrics(gap_report(old, old - 0.1, mask)), RolloutCorrection(rollout_is=None)) is None


def test_host_metrics_reads_every_dtype_exactly():
    metrics = {"a": torch.tensor(0.1, dtype=torch.float64), "b": torch.tensor(1 / 3, dtype=torch.float32),
               "c": torch.tensor(float("inf"), dtype=torch.float64), "d": torch.tensor(3)}
    read = host_metrics(metrics)
    assert read == {k: float(v) for k, v in metrics.items()} and all(type(v) is float for v in read.values())
    assert host_metrics({}) == {}


def test_a_step_whose_weights_icepop_all_zeroes_is_one_sentence_naming_the_key():
    """The refusal reaches the trainer as a UserError from `ExperienceMaker.prepare`, before any update."""
    from portagrpo.algo.objective import Shaping
    from portagrpo.batch import RolloutBatch
    from portagrpo.errors import UserError
    from portagrpo.train.experience import ExperienceMaker, ExperienceSettings, ScoredRollout

    def step(log_ratio: float) -> ScoredRollout:
        rollout_logp = torch.full((4, 3), -1.0)
        rb = RolloutBatch(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long),
                          torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3), torch.tensor([0, 0, 1, 1]),
                          torch.tensor([0, 0, 1, 1]), [""] * 4, [""] * 4, [""] * 4, [{}] * 4, rollout_logp=rollout_logp)
        return ScoredRollout(rb, scores=torch.tensor([0.0, 1.0, 1.0, 0.0]), correct=torch.zeros(4), reward_errors=0.0,
                             old_logp=rollout_logp + log_ratio, ref_logp=None, entropy=None, t_gen=0.0, t_scored=0.0)

    cfg = load_config(None, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_5.0"])
    maker = ExperienceMaker(ExperienceSettings.from_config(cfg), Shaping())
    exp = maker.prepare(step(0.1))
    assert all(type(v) is float for v in exp.rollout_corr.values())
    assert exp.rollout_corr[PREFIX + "rollout_is_mean"] == pytest.approx(math.exp(0.1), rel=1e-6)
    with pytest.raises(UserError, match=r"rollout_is_threshold: every importance weight .* widen the bounds"):
        maker.prepare(step(3.0))  # every ratio e^3 > 5

"""DAPO: dynamic sampling (groups whose metric is the same for every response are dropped and more prompts
sampled until the batch is full) and overlong reward shaping, as verl's DAPO recipe does them."""
from pathlib import Path

import pytest
import torch

from portagrpo.algo.advantages import groups_with_spread, overlong_penalty
from portagrpo.cli import main
from portagrpo.config import ConfigError, load_config
from portagrpo.metrics import read_metrics

DAPO = str(Path(__file__).resolve().parents[2] / "configs" / "dapo.yaml")
FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16",
        "data.train_size=64", "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=8",
        "reward.overlong_buffer.len=4", "trainer.plot=false", "trainer.tensorboard=false", "reward.num_workers=0"]


def test_overlong_penalty_and_group_spread():
    lengths = torch.tensor([2, 4, 5, 7, 8])
    # no penalty up to max - buffer = 4 tokens, then linear down to -factor at 8
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    uid = torch.tensor([0, 0, 1, 1, 2, 2])
    assert groups_with_spread(values, uid).tolist() == [False, False, True, True, False, False]


def _half_tied_reward(tmp_path) -> str:
    """Prompts whose answer is even score a constant (a tied group, no advantage); the others by length."""
    f = tmp_path / "half.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    if sum(map(ord, str(ground_truth))) % 2 == 0:\n        return 0.5\n"
                 "    return float(len(solution_str) % 3)\n")
    return f"reward.function={f}:score"


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", DAPO, "--output-dir", str(run), *FAST, "trainer.total_steps=3",
                 _half_tied_reward(tmp_path)]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["zero_std_group_frac"] == 0.0 for r in rows)  # every kept group carries an advantage
    assert any(r["gen_rounds"] > 1 for r in rows)  # tied groups were dropped and more prompts sampled
    assert all(r["response_len_mean"] > 0 for r in rows)


def test_dynamic_sampling_stops_with_a_sentence_after_its_limit(tmp_path, capsys):
    const = tmp_path / "const.py"
    const.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    assert main(["train", "--config", DAPO, "--output-dir", str(tmp_path / "run"), *FAST, "trainer.total_steps=1",
                 f"reward.function={const}:score", "algorithm.filter_groups.max_num_gen_batches=2",
                 "reward.overlong_buffer.enable=false"]) == 2  # no length penalty: every group is tied
    err = capsys.readouterr().err
    assert "after 2 sampling rounds (algorithm.filter_groups.max_num_gen_batches=2) only 0 of 4 prompt groups" in err


def test_unlimited_dynamic_sampling_says_it_is_still_sampling(tmp_path, capsys):
    """max_num_gen_batches=0 (no limit) with a reward without spread samples on, as verl does, but never in
    silence: every NOTICE_EVERY rounds a line with the rounds so far, the groups kept and dropped and the key
    that bounds it. The reward here is constant for the first 25 rounds (16 responses each), then spreads,
    so the run ends by itself."""
    from portagrpo.train.pipeline import NOTICE_EVERY

    reward = tmp_path / "flat_then_spread.py"
    reward.write_text("calls = 0\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    global calls\n    calls += 1\n"
                      "    return 1.0 if calls <= 25 * 16 else float(calls % 2)\n")
    run = tmp_path / "run"
    assert main(["train", "--config", DAPO, "--output-dir", str(run), *FAST, "trainer.total_steps=1",
                 f"reward.function={reward}:score", "algorithm.filter_groups.max_num_gen_batches=0",
                 "reward.overlong_buffer.enable=false"]) == 0
    out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if "still sampling" in line]
    assert NOTICE_EVERY == 10 and len(notices) == 2
    assert "step 1: still sampling after gen_rounds=10: 0 of 4 prompt groups kept, 40 dropped (the same score " \
           "for every response); algorithm.filter_groups.max_num_gen_batches=0 sets no limit" in notices[0]
    assert "gen_rounds=20: 0 of 4 prompt groups kept, 80 dropped" in notices[1]
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["gen_rounds"] > 25 and row["zero_std_group_frac"] == 0.0


def test_dynamic_sampling_on_two_ranks(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--config", DAPO, "--output-dir", str(run), *FAST,
                 "trainer.total_steps=2", "trainer.nproc_per_node=2", _half_tied_reward(tmp_path)]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert all(r["zero_std_group_frac"] == 0.0 for r in rows)


def test_overlong_shaping_lowers_long_responses_scores(tmp_path):
    from portagrpo.train import Trainer

    t = Trainer(load_config(None, [*FAST, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                                   "reward.overlong_buffer.penalty_factor=2.0"]), run_dir=tmp_path,
                log=lambda m: None).setup()
    rb = t.pipeline.rollout(t.parts.data.loader.next_batch(), 4, t.pipeline.settings.sampling, uid_base=0)
    shaped = t.pipeline.shaped_scores(rb, [1.0] * rb.size)
    lengths = torch.tensor([r for _, r in rb.host_lengths()], dtype=torch.float32)
    expected = 1.0 + torch.clamp(-(lengths - 4) / 4 * 2.0, max=0.0)
    assert torch.allclose(shaped, expected)


def test_dapo_settings_are_checked():
    with pytest.raises(ConfigError, match="reward.overlong_buffer.len=0 must be between 1"):
        load_config(None, ["reward.overlong_buffer.enable=true"])
    cfg = load_config(None, ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4",
                             "reward_model.reward_manager=dapo", "algorithm.filter_groups.enable=True",
                             "algorithm.filter_groups.metric=acc", "data.gen_batch_size=48"])
    assert cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.len == 4
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"

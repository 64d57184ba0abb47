"""The tool-use demo end to end through the CLI, shortened: `portagrpo warmstart` (the Hermes call's format, a random
operator), then `portagrpo train --config configs/calc-tool-cpu.yaml`. The policy must learn to call the calculator
on every prompt and with the operator the prompt's word names: the tool-call rate and the reward both rise."""
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STEPS = 80


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.slow
def test_the_policy_learns_to_call_the_calculator(tmp_path):
    policy, run = tmp_path / "warm", tmp_path / "run"
    assert main(["warmstart", "--out", str(policy)]) == 0  # the default 1000 steps: fewer copy the result badly
    tools = ROOT / "configs" / "tools" / "calculator.yaml"
    assert main(["train", "--config", str(ROOT / "configs" / "calc-tool-cpu.yaml"), "--output-dir", str(run),
                 f"model.path={policy}", f"rollout.multi_turn.tool_config_path={tools}",
                 f"trainer.total_steps={STEPS}", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.plot=false",
                 "trainer.tensorboard=false", "trainer.progress_bar=false"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    samples = 16 * 8  # data.train_batch_size x rollout.n of the recipe
    for r in rows:
        r["calls_per_sample"] = r["tool/calls"] / samples
    first, last = rows[:10], rows[-10:]
    # the warm start calls about half the time; GRPO makes it call every time
    assert 0.3 < _mean(first, "calls_per_sample") < 0.8, _mean(first, "calls_per_sample")
    assert _mean(last, "calls_per_sample") > 0.9, _mean(last, "calls_per_sample")
    # a third of its calls have the right operator at first; the reward (exact answers) rises as it learns which
    assert _mean(last, "reward_mean") >= _mean(first, "reward_mean") + 0.15, (_mean(first, "reward_mean"),
                                                                           _mean(last, "reward_mean"))

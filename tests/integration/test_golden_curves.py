"""The CLI's first steps against stored curves (STYLE rule 11): loss, reward and grad-norm of the default train
for each batch source (sync, one_step_off, DAPO's filtered sampling). A refactor that changes the numbers fails
here, loudly, even where the equivalence tests (1 rank == 2 ranks, resume == straight) still agree.

Regenerate only for an intended change of the numbers, and say why in the commit:
    python tests/integration/test_golden_curves.py --regenerate
"""
import json
import math
import sys
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.metrics import read_metrics
from portagrpo.tolerances import CURVE_TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"
STEPS = 4
COMMON = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "trainer.test_freq=0",
          "trainer.save_freq=0", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
          "actor.micro_batch_size=4", "data.train_size=64", "data.val_size=8", "trainer.num_threads=1",
          f"trainer.total_steps={STEPS}"]
SOURCES = {
    "sync": [],
    "one_step_off": ["rollout.mode=one_step_off"],
    "dapo": ["--config", str(ROOT / "configs" / "dapo.yaml")],
}
KEYS = tuple(CURVE_TOLERANCE)


def run_curve(name: str, run_dir: Path) -> list[dict[str, float]]:
    assert main(["train", "--output-dir", str(run_dir), *COMMON, *SOURCES[name]]) == 0
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_cli_repeats_its_stored_curve(tmp_path, name):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run_curve(name, tmp_path / name)
    assert [r["step"] for r in got] == [r["step"] for r in golden] == list(range(1, STEPS + 1))
    for want, have in zip(golden, got):
        for key in KEYS:
            bound = CURVE_TOLERANCE[key] * max(1.0, abs(want[key]))
            assert math.isfinite(have[key]) and abs(have[key] - want[key]) <= bound, (
                f"{name} step {want['step']} {key}: {have[key]!r}, stored {want[key]!r}")


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    import tempfile

    for source in SOURCES:
        with tempfile.TemporaryDirectory() as tmp:
            curve = run_curve(source, Path(tmp) / source)
        (GOLDEN / f"{source}.json").write_text(json.dumps(curve, indent=1) + "\n")
        print(source, curve)

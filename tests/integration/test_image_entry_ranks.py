"""On two ranks, an image the processor cannot take (or would shrink) is refused in one sentence naming its row,
as on one: no rank prints the processor's traceback first."""
import base64
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.model import vision  # noqa: E402

pytestmark = pytest.mark.skipif(vision.vision_support_problem() is not None,
                                reason=str(vision.vision_support_problem()))


def _row(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return json.dumps({"prompt": [{"role": "user", "content": "<image>What colour?"}],
                       "images": [{"bytes": base64.b64encode(out.getvalue()).decode(), "path": None}],
                       "reward_model": {"ground_truth": "red"}, "data_source": "colours"}) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("size, expected", [((1000, 1), "is 1000x1, an aspect ratio over the 200:1"),
                                            ((300, 200), "is 300x200 = 60000 pixels, over the model's limit")])
def test_two_ranks_refuse_an_image_in_one_sentence(tmp_path, size, expected):
    data = tmp_path / "d.jsonl"
    data.write_text(_row(56, 56) * 3 + _row(*size) + _row(56, 56) * 4)
    done = subprocess.run(
        [sys.executable, "-m", "portagrpo", "train", "--output-dir", str(tmp_path / "run"), "trainer.nproc_per_node=2",
         "model.tiny.vision=true", "model.tiny.num_heads=2", "data.task=null", f"data.train_files=[{data}]",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8", "reward.function=colours",
         "trainer.progress_bar=false"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "ValueError" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"d.jsonl row 4 image 1 {expected}" in errors[0]

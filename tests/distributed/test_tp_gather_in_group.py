"""Issue 45: a tensor-parallel vLLM group's requests, a vision-language policy's raw images with them, are gathered
within the group only (before: across every rank of the world, each rank then keeping its group's part). Four CPU
ranks, TP=2 (tp_gather_worker.py)."""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_data_parallel import ENV  # noqa: E402


def test_a_groups_images_reach_only_its_own_ranks(tmp_path):
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "4", str(HERE / "tp_gather_worker.py"), str(tmp_path)]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["senders"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # before: [0, 1, 2, 3] on every rank
    assert all(r["mine_is_local"] and r["count"] == 4 for r in ranks)
    assert ranks[0]["seed"] == ranks[1]["seed"] != ranks[2]["seed"] == ranks[3]["seed"]

"""vLLM's expert parallelism (rollout.expert_parallel_size) and the one-expert-at-a-time push, measured on the emulated
device's per-rank byte count (issue 53 item 3): test_sharded_load's MoE shape (experts outweigh the rest) trains 2
steps under trainer.parallel=ep on 2 and 4 emulated ranks with the vLLM engine played by the stand-in as a GPU build,
whose engine keeps what it is given on the device. With every engine keeping every expert, the push peak barely falls
with the ranks (each engine receives and holds every expert); with vLLM's experts split over the ranks, each engine
receives and holds its block, and the push peak falls with them. Measured (GiB a rank, the larger step's push):
whole 0.359 at 2 ranks, 0.332 at 4; split 0.218 and 0.122."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_emulated_device import ENV, pytestmark  # noqa: F401 - the same skip rule

from portagrpo.model.expert_parallel import ep_import_problem

HERE = Path(__file__).resolve().parent


def _run(out: Path, ranks: int, split: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", str(ranks), str(HERE / "vllm_ep_push_check.py"),
           str(out), "ep", "1" if split else "0"]
    res = subprocess.run(cmd, env={**ENV, "PORTAGRPO_EMU_DEVICES": "1"}, capture_output=True, text=True, timeout=1200,
                         cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(ep_import_problem() is not None, reason=str(ep_import_problem()))
def test_the_push_peak_falls_with_the_ranks_when_vllm_splits_the_experts(tmp_path):
    rows = {(ranks, split): _run(tmp_path / f"r{ranks}{int(split)}", ranks, split)
            for ranks in (2, 4) for split in (False, True)}
    push = {k: max(row["mem/push_peak_gb"] for row in v) for k, v in rows.items()}
    assert all(len(v) == 2 for v in rows.values())
    assert push[(2, True)] < 0.8 * push[(2, False)], push
    assert push[(4, True)] < 0.5 * push[(4, False)], push
    assert push[(4, True)] <= 0.6 * push[(2, True)], push  # falls with the ranks: each engine its block
    assert push[(4, False)] >= 0.85 * push[(2, False)], push  # does not: each engine every expert

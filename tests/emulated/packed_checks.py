"""Packed rows on a device (argv[1]: emu, or npu on the simulated Ascend): tests/unit/test_packed_rows.py's text rows
(shorter), packed in fp32 through the backend's answer (npu_fusion_attention's TND layout on Ascend, block-diagonal SDPA
elsewhere), against the padded grid. Prints one JSON line: the relative errors and how many varlen calls ran."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_packed_rows import packed_vs_padded  # noqa: E402

from portagrpo.backends import get_backend  # noqa: E402
from portagrpo.model import scorer, ulysses  # noqa: E402


def main() -> None:
    backend = get_backend(sys.argv[1])
    device = backend.device(0)
    attention = backend.attention_implementation("auto", torch.float32)
    varlen, calls = backend.varlen_attention(attention), []

    def counted(*args):
        calls.append(args[3])
        return varlen(*args)

    # shorter rows than the CPU test's (the cap is the CPU test's point; here the device's path is), sent through the
    # packed row as longer ones would be
    scorer.MAX_DENSE_PACKED_MASK = 0
    blocks = []
    real = ulysses.block_diagonal_attention
    ulysses.block_diagonal_attention = lambda q, k, v, lens, *a: blocks.append(lens) or real(q, k, v, lens, *a)
    errors = packed_vs_padded(device, torch.float32, attention, spy=counted if varlen else None,
                              lengths=[(10, 300), (4, 200), (30, 150)])
    print(json.dumps({"errors": errors, "attention": attention, "varlen_calls": len(calls),
                      "block_diagonal_calls": len(blocks)}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

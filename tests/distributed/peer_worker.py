"""Two ranks over gloo where rank 1 dies (or hangs); rank 0 must stop with a clear error."""
import os
import sys
import time

import torch

from portagrpo.backends.cpu import CPUBackend
from portagrpo.backends.dist import PeerFailure, init_collectives


def main() -> int:
    mode, timeout = sys.argv[1], float(sys.argv[2])
    comm = init_collectives(CPUBackend(), timeout)
    comm.all_reduce_sum(torch.ones(1))  # both ranks are up
    if comm.rank == 1:
        if mode == "die":
            os._exit(3)
        time.sleep(timeout * 6)
        return 0
    try:
        comm.all_reduce_sum(torch.ones(1))
    except PeerFailure as err:
        print(f"portagrpo: error: {err}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

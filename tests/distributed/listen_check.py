"""Run by `python -m portagrpo.launcher --nproc 2`: once the group has formed, rank 0 prints (as JSON)
the address of every listening TCP socket held by the launcher or any of its ranks (Linux /proc)."""
import json
import os

from portagrpo.backends.cpu import CPUBackend
from portagrpo.backends.dist import init_collectives
from portagrpo.procs import LAUNCHER_ENV


def tree(root: int) -> list[int]:
    pids = [root]
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == root:
                pids.append(int(entry))
        except OSError:
            pass  # the process ended meanwhile
    return pids


def listening(pids: list[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for row in open(f"/proc/net/{table}").read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, owned by one of the processes
                found.append(cols[1].split(":")[0])
    return found


comm = init_collectives(CPUBackend(), timeout_s=120)
comm.barrier()  # every rank's sockets exist
if comm.rank == 0:
    print(json.dumps(listening(tree(int(os.environ.get(LAUNCHER_ENV, os.getppid()))))), flush=True)  # or torchrun
comm.barrier()
comm.close()

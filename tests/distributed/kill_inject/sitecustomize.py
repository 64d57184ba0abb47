"""Kills a whole run with SIGKILL at the worst moment of a sharded save (tests/distributed/test_sharded_checkpoint.py).

On the PYTHONPATH of a test's training processes only. PORTAGRPO_TEST_KILL_AT_MANIFEST=N: when rank 0 is about to
write the manifest of its N-th checkpoint (every rank's shards written and fsynced, the temporary not yet renamed),
the run's process group (the launcher and every rank) is killed -9. The patch wraps portagrpo's own function from
outside, so the code under test is unchanged.
"""
import os

_AT = int(os.environ.get("PORTAGRPO_TEST_KILL_AT_MANIFEST", "0") or 0)


def _inject() -> None:
    import signal

    import portagrpo.checkpoint as checkpoint

    original, calls = checkpoint._write_manifest, [0]

    def killing(tmp, step, files):
        calls[0] += 1
        if calls[0] == _AT:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return original(tmp, step, files)

    checkpoint._write_manifest = killing


if _AT:
    _inject()

"""The tool sandbox's plumbing, attacked from inside a call (issue 49): no way back into the trainer, no job but the
call's own in its memory, site-packages under /tmp importable, no new user namespaces, and at the `process` level
no trainer's environment for a root trainer.

Each attack runs as a real call, from a user tool and from the `python` built-in's model-written code, at both
levels (`namespaces` skipped with the host's reason where the host forbids it)."""
import contextlib
import json
import os
import pickle
import socket
import struct
import sys
import uuid

import pytest

from portagrpo.agent import wire
from portagrpo.agent.isolation import SANDBOX_ID, probe
from portagrpo.agent.sandbox import Limits, ToolJob, ToolSandbox

HOST = probe()
LEVELS = [pytest.param("namespaces", marks=pytest.mark.skipif(HOST.level != "namespaces",
                                                              reason=f"namespaces refused here: {HOST.reason}")),
          "process"]
SECRET_PATTERN = "GTSECRET"  # + 16 hex digits: the ground truths the memory search looks for

# The exploit of issue 49: write a forged multiprocessing message (a pickle whose __reduce__ runs a command) to every
# socket this process holds (the worker's, to the trainer, before the fix). {mark} is the file the command would
# create.
EXPLOIT = '''
import os, pickle, stat, struct, json
class Boom:
    def __reduce__(self):
        return (os.system, ("touch {mark}",))
payload = pickle.dumps(("result", (0, Boom())))
frame = struct.pack("!i", len(payload)) + payload
held, sent = sorted(int(n) for n in os.listdir("/proc/self/fd")), []
for fd in held:
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.write(fd, frame)
            sent.append(fd)
    except OSError:
        pass
print(json.dumps({{"held": held, "sent": sent}}))
'''

TOOLS = '''
import ctypes, errno, gc, json, os, re

def exploit(mark: str):
    exec(EXPLOIT.format(mark=mark), {})
    return ""

def truth(ground_truth: str = ""):
    return "seen" if ground_truth else "none"

def search():
    """Every ground truth in this process's memory: its Python objects, then its anonymous memory, byte by byte."""
    pattern = re.compile(rb"GTSECRET[0-9a-f]{16}")
    found = set()
    for obj in gc.get_objects():
        try:
            text = repr(obj)
        except Exception:
            continue
        if "GTSECRET" in text:
            found.update(m.decode() for m in pattern.findall(text.encode(errors="replace")))
    with open("/proc/self/maps") as f:
        regions = f.read().splitlines()
    scanned = 0
    for line in regions:
        fields = line.split()
        if "r" not in fields[1] or (len(fields) > 5 and not fields[5].startswith("[heap")):
            continue
        if len(fields) > 5 and fields[5].startswith("[v"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        for at in range(lo, hi, 1 << 22):
            end = min(at + (1 << 22) + 64, hi)
            chunk = ctypes.string_at(at, end - at)
            found.update(m.decode() for m in pattern.findall(chunk))
            scanned += end - at
    return json.dumps({"found": sorted(found), "scanned": scanned})

def nested():
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.unshare(0x10000000)  # CLONE_NEWUSER
    unshare = "ok" if got == 0 else errno.errorcode[ctypes.get_errno()]
    try:
        os.chroot("/")
        chroot = "ok"
    except OSError as err:
        chroot = errno.errorcode[err.errno]
    return json.dumps({"unshare": unshare, "chroot": chroot})

def environ_of(pid: int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            seen = f.read().decode(errors="replace")
    except OSError as err:
        seen = errno.errorcode[err.errno]
    return json.dumps({"uid": os.getuid(), "environ": seen})

def imports():
    import ptg_probe_module
    return str(ptg_probe_module.VALUE)

def where():
    import tempfile
    return os.getcwd()
'''
NAMES = ["exploit", "truth", "search", "nested", "environ_of", "imports", "where"]


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plumbing")
    (folder / "plumbing.py").write_text(f"EXPLOIT = {EXPLOIT!r}\n{TOOLS}")
    return folder


@pytest.fixture(scope="module")
def venv_under_tmp():
    """A site-packages folder under /tmp on the workers' sys.path, as a virtual environment kept there shows it."""
    import tempfile

    root = tempfile.mkdtemp(prefix="ptg-venv-", dir="/tmp")
    os.chmod(root, 0o755)  # as `python -m venv` leaves it: a `process`-level call may run as another uid
    site = os.path.join(root, "lib", "python3", "site-packages")
    os.makedirs(site)
    with open(os.path.join(site, "ptg_probe_module.py"), "w") as f:
        f.write("VALUE = 4242\n")
    sys.path.append(site)
    yield site
    sys.path.remove(site)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=LEVELS)
def box(request, tools, venv_under_tmp):
    targets = {name: f"{tools / 'plumbing.py'}:{name}" for name in NAMES}
    targets["python"] = "builtin:python"
    os.environ["PORTAGRPO_PLUMBING_SECRET"] = "s3cr3t-of-the-trainer"
    try:
        sandbox = ToolSandbox(targets, Limits(timeout_s=20.0, memory_mb=512, max_output_bytes=1 << 16), workers=1,
                              setting=request.param)
        sandbox.start()
    finally:
        del os.environ["PORTAGRPO_PLUMBING_SECRET"]
    yield sandbox
    sandbox.close()


@contextlib.contextmanager
def truth_box(tools):
    """A one-worker `process`-level sandbox with the `truth` tool, started, closed after."""
    sandbox = ToolSandbox({"truth": f"{tools / 'plumbing.py'}:truth"}, Limits(timeout_s=10.0), workers=1,
                          setting="process")
    try:
        sandbox.start()
        yield sandbox
    finally:
        sandbox.close()


def call(box, name, context=None, **arguments):
    [result] = box.run([ToolJob(name, "", arguments, context or {})])
    return result


@pytest.mark.parametrize("how", ["user tool", "python built-in"])
def test_a_forged_message_from_a_call_never_runs_in_the_trainer(box, tmp_path, how):
    mark = tmp_path / f"pwned-{uuid.uuid4().hex[:6]}"
    if how == "user tool":
        result = call(box, "exploit", mark=str(mark))
    else:
        result = call(box, "python", code=EXPLOIT.format(mark=mark))
    assert result.error is None, result.text
    seen = json.loads(result.text.strip().splitlines()[-1])
    assert seen["sent"] == [], f"the call held sockets that lead out: {seen}"
    assert len(seen["held"]) <= 5  # stdin, its output twice, its status pipe, and the listing's own
    assert not mark.exists()
    assert call(box, "truth", context={"ground_truth": "x"}).text == "seen"  # the worker still answers


def test_a_call_holds_no_other_job_nor_a_truth_it_did_not_ask_for(box):
    first, second = (f"{SECRET_PATTERN}{uuid.uuid4().hex[:16]}" for _ in range(2))
    assert call(box, "truth", context={"ground_truth": first}).text == "seen"
    result = call(box, "search", context={"ground_truth": second})
    assert result.error is None, result.text
    seen = json.loads(result.text)
    assert seen["scanned"] > 1 << 20  # the search read the call's memory, not nothing
    assert seen["found"] == []


def test_site_packages_under_tmp_import_inside_a_call(box):
    result = call(box, "imports")
    assert result.error is None and result.text == "4242", result.text


def test_a_call_cannot_make_a_user_namespace(box):
    seen = json.loads(call(box, "nested").text)
    assert seen["unshare"] == "EPERM" and seen["chroot"] == "EPERM"


def test_the_trainers_environment_is_out_of_reach(box):
    if box.isolation.level == "process" and os.geteuid() != 0:
        pytest.skip("a non-root trainer's `process`-level calls run as its uid: docs/config.md says its environment "
                    "is readable there")
    seen = json.loads(call(box, "environ_of", pid=os.getpid()).text)
    assert seen["environ"] in ("EACCES", "ENOENT", "EPERM"), seen  # ENOENT: its own PID namespace
    assert seen["uid"] == SANDBOX_ID


def test_a_process_level_call_dir_follows_tmpdir(tmp_path, tools, monkeypatch):
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    sandbox = ToolSandbox({"where": f"{tools / 'plumbing.py'}:where"}, Limits(timeout_s=10.0), workers=1,
                          setting="process")
    try:
        sandbox.start()
        where = call(sandbox, "where").text
    finally:
        sandbox.close()
    assert os.path.dirname(where) == str(tmp_path), where


def test_a_pickle_on_the_wire_is_a_malformed_message_not_a_command(tmp_path):
    mark = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {mark}",))

    ours, theirs = socket.socketpair()
    payload = pickle.dumps(("result", (0, Boom())))
    theirs.sendall(struct.pack("!i", len(payload)) + payload)
    with pytest.raises(wire.WireError, match="not a JSON message"):
        wire.recv(ours)
    theirs.sendall(struct.pack("!I", 1 << 30))
    with pytest.raises(wire.WireError, match="over the"):
        wire.recv(ours)
    theirs.close()
    with pytest.raises(EOFError):
        wire.recv(ours)
    ours.close()
    assert not mark.exists()


def test_a_frame_that_trickles_in_runs_out_of_its_one_deadline():
    import threading
    import time

    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def trickle():  # a header that promises 100 bytes, then one byte every 50 ms, never the whole frame in time
        theirs.sendall(struct.pack("!I", 100))
        while not stop.is_set():
            try:
                theirs.sendall(b" ")
            except OSError:
                return
            time.sleep(0.05)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(wire.WireError, match="did not arrive whole in time"):
        wire.recv(ours, timeout_s=1.0)
    assert time.monotonic() - started < 30  # one deadline for the frame, not one per byte
    stop.set()
    ours.close()
    theirs.close()
    thread.join(timeout=5)


def test_a_replacement_worker_at_a_lower_level_is_never_used(tools):
    """A worker started later whose namespaces were refused would run its calls less isolated: it is refused, and a
    run whose host keeps refusing stops in one sentence."""
    from portagrpo.agent.isolation import Isolation
    from portagrpo.errors import UserError

    with truth_box(tools) as sandbox:
        sandbox.isolation = Isolation("namespaces")  # as if the run had started with namespaces
        with pytest.raises(UserError, match="runs at namespaces, and new tool workers could only reach process"):
            for _ in range(5):
                sandbox._workers[0].ready = False
                sandbox._handle(sandbox._workers[0], "ready", {"kind": "ready", "takes": {"truth": []},
                                                              "isolation": {"level": "process", "reason": "x"}}, [])
                sandbox._fill()


def test_a_worker_that_sends_garbage_fails_its_call_and_is_replaced(tools):
    with truth_box(tools) as sandbox:
        worker = sandbox._workers[0]
        worker.sock.close()
        peer_a, peer_b = socket.socketpair()
        worker.sock = peer_a  # the trainer reads from a peer that writes a forged multiprocessing message
        payload = pickle.dumps(("result", (0, "forged")))
        peer_b.sendall(struct.pack("!i", len(payload)) + payload)
        worker.task = 0
        results = [None]
        sandbox._receive(worker, results)
        assert results[0].error == "crash" and "malformed message" in results[0].text
        assert worker not in sandbox._workers
        peer_b.close()
        assert call(sandbox, "truth", context={"ground_truth": "y"}).text == "seen"  # a new worker answers


def test_an_oversized_job_is_an_arguments_error(tools):
    with truth_box(tools) as sandbox:
        result = call(sandbox, "truth", context={"ground_truth": "z" * (3 << 20)})
        assert result.error == "arguments" and "limit of one call" in result.text
        assert call(sandbox, "truth", context={"ground_truth": "z"}).text == "seen"


def _run_bpf(rows, arch: int, nr: int, arg0: int) -> int:
    """A classic-BPF interpreter for the four instructions the filter uses, over a `struct seccomp_data`."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = rows[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_user_namespace_filter_refuses_only_what_it_should(machine):
    import errno

    from portagrpo.agent.isolation import (
        CLONE_NEWNET,
        CLONE_NEWUSER,
        SECCOMP_ARCHES,
        SECCOMP_RET_ALLOW,
        SECCOMP_RET_ERRNO,
        user_namespace_filter,
    )

    rows = user_namespace_filter(machine)
    arch, unshare, clone, clone3 = SECCOMP_ARCHES[machine]
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    assert _run_bpf(rows, arch, unshare, CLONE_NEWUSER) == eperm
    assert _run_bpf(rows, arch, unshare, CLONE_NEWUSER | CLONE_NEWNET) == eperm
    assert _run_bpf(rows, arch, unshare, CLONE_NEWNET) == SECCOMP_RET_ALLOW  # `process` drops the network so
    assert _run_bpf(rows, arch, clone, CLONE_NEWUSER | 0x11) == eperm
    assert _run_bpf(rows, arch, clone, 0x11) == SECCOMP_RET_ALLOW  # fork
    assert _run_bpf(rows, arch, clone3, 0) == enosys
    assert _run_bpf(rows, arch, 0, CLONE_NEWUSER) == SECCOMP_RET_ALLOW  # read(2), whatever its argument
    assert _run_bpf(rows, arch, 0x40000000 | unshare, 0) == eperm  # x32
    assert _run_bpf(rows, 0x40000003, unshare, 0) == eperm  # i386 on x86_64


def test_the_filter_is_refused_in_one_sentence_where_it_is_not_written():
    from portagrpo.agent.isolation import SetupError, user_namespace_filter

    with pytest.raises(SetupError, match="new user namespaces cannot be refused on s390x"):
        user_namespace_filter("s390x")

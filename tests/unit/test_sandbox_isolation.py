"""The tool sandbox's abuse suite (issue 40): what model-written code in a tool call tries, and what stops it.

Each abuse runs as a real call in the namespaces level (skipped, with the host's reason, where the host forbids
namespaces) and must be contained: the secret, the host's files and the network out of reach, nothing written
outside the call's /tmp, no process left behind, and the next call still answered. The process level and the
decisions around it (auto refusing model-written code, stale directories) are tested without namespaces."""
import json
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from portagrpo.agent.isolation import SANDBOX_ID, Isolation, probe
from portagrpo.agent.sandbox import TEMP_PREFIX, Limits, ToolJob, ToolSandbox, remove_stale_dirs
from portagrpo.errors import UserError

SECRET = f"hunter2-{uuid.uuid4().hex[:8]}"
MARK = f"{time.time() % 1000:.6f}"  # a grandchild's sleep argument: how the test finds it in the host's ps
BOMB = f"{time.time() % 1000 + 1000:.6f}"  # the fork bomb's processes' sleep argument

TOOLS = f'''
import os, socket, subprocess, time

def read(path: str):
    with open(path, "rb") as f:
        return f.read(4096).decode(errors="replace")

def environs():
    """Every environment this call can read, its own and every process's it can see."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(read(f"/proc/{{pid}}/environ"))
            except OSError:
                pass
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    return {{"env": dict(os.environ), "proc": found, "pids": pids}}

def write(path: str):
    with open(path, "w") as f:
        f.write("written")
    return "wrote"

def escape():
    subprocess.Popen(["sleep", "{MARK}"], start_new_session=True)
    return "escaped"

def bomb():
    while True:
        try:
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{BOMB}"])
        except OSError:
            time.sleep(0.01)

def connect(port: int):
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.sendall(b"hello")
    return "connected"

def allocate():
    return len(bytearray(10 * 2**30))

def exits():
    os._exit(3)

def whoami():
    return {{"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(), "home": os.environ.get("HOME")}}
'''
NAMES = ["read", "environs", "write", "escape", "bomb", "connect", "allocate", "exits", "whoami"]

HOST = probe()
needs_namespaces = pytest.mark.skipif(HOST.level != "namespaces", reason=f"namespaces refused here: {HOST.reason}")


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    folder = tmp_path_factory.mktemp("abuse")
    (folder / "abuse.py").write_text(TOOLS)
    (folder / "config.yaml").write_text("a run's config: not for the tools\n")
    return folder


@pytest.fixture(scope="module")
def sandbox(tools):
    os.environ["PORTAGRPO_ABUSE_SECRET"] = SECRET
    try:
        targets = {name: f"{tools / 'abuse.py'}:{name}" for name in NAMES}
        box = ToolSandbox(targets, Limits(timeout_s=4.0, memory_mb=256, max_output_bytes=1 << 16), workers=2,
                          setting="namespaces")
        box.start()
    finally:
        del os.environ["PORTAGRPO_ABUSE_SECRET"]
    yield box
    box.close()


def run(box, name, network=False, **arguments):
    [result] = box.run([ToolJob(name, "", arguments, {}, network)])
    return result


def answers(box) -> bool:
    return run(box, "whoami").error is None


def _host_processes(word: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,uid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if word in line and "ps -eo" not in line]


@needs_namespaces
def test_the_run_says_its_isolation(sandbox):
    assert sandbox.isolation.level == "namespaces"
    line = sandbox.isolation.describe()
    assert line.startswith("tool sandbox: namespaces") and "uid 65534" in line and "no network" in line


@needs_namespaces
def test_no_environment_of_the_trainer_is_readable(sandbox):
    result = run(sandbox, "environs")
    seen = json.loads(result.text)
    assert set(seen["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR"}
    assert seen["pids"] == [1]  # its own PID namespace: no worker, no trainer to read
    assert not any(SECRET in text for text in seen["proc"])


@needs_namespaces
@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd-", "/root/.bashrc", "/proc/1/root/etc/shadow"])
def test_host_secrets_are_not_there(sandbox, path):
    result = run(sandbox, "read", path=path)
    assert result.error == "exception" and ("FileNotFoundError" in result.text or "PermissionError" in result.text)
    assert answers(sandbox)


@needs_namespaces
def test_the_run_directory_is_not_there(sandbox, tools):
    result = run(sandbox, "read", path=str(tools / "config.yaml"))
    assert result.error == "exception" and "not for the tools" not in result.text


@needs_namespaces
def test_writes_outside_the_call_tmp_fail_and_tmp_is_private(sandbox, tools, tmp_path):
    for target in (tmp_path / "out.txt", "/usr/out.txt", tools / "abuse.py"):
        result = run(sandbox, "write", path=str(target))
        assert result.error == "exception", target
    assert not (tmp_path / "out.txt").exists() and "def read" in (tools / "abuse.py").read_text()
    assert run(sandbox, "write", path="/tmp/mine.txt").text == "wrote"
    later = run(sandbox, "read", path="/tmp/mine.txt")  # the next call has a /tmp of its own
    assert later.error == "exception" and "FileNotFoundError" in later.text


@needs_namespaces
def test_runs_as_an_unprivileged_uid(sandbox):
    seen = json.loads(run(sandbox, "whoami").text)
    assert seen == {"uid": SANDBOX_ID, "gid": SANDBOX_ID, "cwd": "/tmp", "home": "/tmp"}


@needs_namespaces
def test_a_setsid_grandchild_dies_with_the_call(sandbox):
    result = run(sandbox, "escape")
    assert result.error is None and result.text == "escaped"
    for _ in range(50):
        if not _host_processes(f"sleep {MARK}"):
            break
        time.sleep(0.1)
    assert _host_processes(f"sleep {MARK}") == []


@needs_namespaces
def test_a_fork_bomb_is_bounded_and_leaves_nothing(sandbox):
    result = run(sandbox, "bomb")
    assert result.error == "timeout" and "limit and was stopped" in result.text
    for _ in range(50):
        if not _host_processes(f"sleep {BOMB}"):
            break
        time.sleep(0.1)
    assert _host_processes(f"sleep {BOMB}") == []
    assert answers(sandbox)


@needs_namespaces
def test_no_network_unless_the_tool_asks_for_it(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(10)
    port = server.getsockname()[1]
    accepted = []

    def serve():
        try:
            conn, _ = server.accept()
            accepted.append(conn.recv(16))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    refused = run(sandbox, "connect", port=port)
    assert refused.error == "exception" and refused.network_isolated is True and accepted == []
    allowed = run(sandbox, "connect", network=True, port=port)  # a tool whose config says network: true
    thread.join(timeout=10)
    server.close()
    assert allowed.error is None and allowed.text == "connected" and accepted == [b"hello"]


@needs_namespaces
def test_a_10gb_allocation_is_a_memory_error(sandbox):
    result = run(sandbox, "allocate")
    assert result.error == "memory" and "256 MB memory limit" in result.text
    assert answers(sandbox)


@needs_namespaces
def test_a_tools_own_exit_code_is_told_as_such(sandbox):
    result = run(sandbox, "exits")
    assert result.error == "crash" and "exited with code 3" in result.text and "memory" not in result.text


@needs_namespaces
def test_nothing_is_left_on_the_host(sandbox):
    import tempfile

    run(sandbox, "write", path="/tmp/left.txt")
    workers = {str(w.proc.pid) for w in sandbox._workers}
    mine = [p for p in os.listdir(tempfile.gettempdir())
            if p.startswith(TEMP_PREFIX) and p[len(TEMP_PREFIX):].split("-")[0] in workers]
    assert workers and mine == []


def test_a_tool_that_hangs_at_import_names_itself_and_the_rank(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(600)\n\ndef f():\n    return 1\n")
    box = ToolSandbox({"slow_tool": f"{tmp_path / 'slow.py'}:f"}, Limits(timeout_s=2.0), workers=1, rank=1)
    with pytest.raises(UserError, match=r"^rank 1: the tool 'slow_tool' did not import within 3s"):
        box.start(import_timeout_s=3.0)
    box.close()


def test_auto_refuses_model_written_code_without_namespaces():
    """Where the host forbids namespaces, `auto` runs trusted tools at the process level and refuses the ones that
    run model-written code; `namespaces` refuses the run; an explicit `process` takes both."""
    def decide(setting, untrusted):
        box = ToolSandbox({}, Limits(), workers=0, setting=setting, untrusted=untrusted)
        box.isolation = Isolation("process", "unshare: Operation not permitted (EPERM)")
        box._check_isolation()

    decide("auto", ())
    decide("process", ("python",))
    with pytest.raises(UserError, match="the tool.s. python run model-written code.*sandbox=process"):
        decide("auto", ("python",))
    with pytest.raises(UserError, match="sandbox=namespaces, but this host refuses them .unshare: Operation"):
        decide("namespaces", ())


def test_process_level_still_isolates_what_it_can(tmp_path):
    box = ToolSandbox({"whoami": f"{_write_tools(tmp_path)}:whoami", "exits": f"{tmp_path / 'abuse.py'}:exits"},
                      Limits(timeout_s=4.0), workers=1, setting="process")
    try:
        assert box.start().level == "process"
        seen = json.loads(run(box, "whoami").text)
        assert os.path.basename(seen["cwd"]).startswith(f"{TEMP_PREFIX}") and not os.path.exists(seen["cwd"])
        assert "exited with code 3" in run(box, "exits").text
    finally:
        box.close()


def _write_tools(folder):
    (folder / "abuse.py").write_text(TOOLS)
    return folder / "abuse.py"


def test_stale_call_directories_are_removed_at_the_next_start(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{TEMP_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{TEMP_PREFIX}{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    assert remove_stale_dirs() == 1
    assert not stale.exists() and live.exists()


def test_a_refusal_names_the_key_its_setting_came_from():
    """The code generator's sandbox (rollout.code.sandbox) says its own key: following the sentence must change
    what the run reads."""
    box = ToolSandbox({}, Limits(), workers=0, setting="auto", untrusted=("python",), field="rollout.code.sandbox")
    box.isolation = Isolation("process", "unshare: Operation not permitted (EPERM)")
    with pytest.raises(UserError, match=r"with rollout\.code\.sandbox=process\.$"):
        box._check_isolation()

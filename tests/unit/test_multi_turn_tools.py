"""Tools for multi-turn rollouts: the tool file, the built-ins, Hermes parsing, and the sandbox's handling of every
abuse (each one a counted tool error, and the next call still runs)."""
import json
import os
import time

import pytest

from portagrpo.agent.hermes import ToolTurns, parse_tool_calls
from portagrpo.agent.sandbox import Limits
from portagrpo.agent.toolbox import Toolbox, ToolCounts
from portagrpo.agent.tools import calculator, gsm8k
from portagrpo.config.tool_file import load_tool_config
from portagrpo.errors import UserError

ABUSE = '''
import ctypes, os, time

def hang():
    while True:
        pass

def sleeper():
    time.sleep(600)

def crash():
    ctypes.string_at(0)

def boom(x: int):
    raise RuntimeError(f"boom {x}")

def shout():
    print("x" * 5_000_000)

def hog():
    return len(bytearray(3 * 2**30))

def env():
    return {"secret": os.environ.get("PORTAGRPO_TEST_SECRET"), "keys": sorted(os.environ), "cwd": os.getcwd()}

def write_outside(path: str):
    with open(path, "w") as f:
        f.write("written")
    return "ok"

def storm():
    pids = []
    for _ in range(30):
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        pids.append(pid)
    print(os.getpgid(0), flush=True)
    time.sleep(600)
'''
NAMES = ["hang", "sleeper", "crash", "boom", "shout", "hog", "env", "write_outside", "storm"]


def _schema(name, props=None, required=()):
    return {"type": "function", "function": {"name": name, "description": name,
            "parameters": {"type": "object", "properties": props or {}, "required": list(required)}}}


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    import yaml

    folder = tmp_path_factory.mktemp("tools")
    (folder / "abuse.py").write_text(ABUSE)
    props = {"boom": {"x": {"type": "integer"}}, "write_outside": {"path": {"type": "string"}}}
    tools = [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {"type": "native"},
              "tool_schema": _schema("calc_gsm8k_reward", {"answer": {"type": "string"}}, ["answer"])},
             {"class_name": "calculator", "tool_schema": _schema("calculator", {"expression": {"type": "string"}},
                                                                 ["expression"])},
             {"class_name": "python", "tool_schema": _schema("python", {"code": {"type": "string"}}, ["code"])}]
    tools += [{"callable": f"abuse.py:{n}", "tool_schema": _schema(n, props.get(n), list(props.get(n, {})))}
              for n in NAMES]
    (folder / "tools.yaml").write_text(yaml.safe_dump({"tools": tools}))
    os.environ["PORTAGRPO_TEST_SECRET"] = "hunter2"
    try:
        box = Toolbox.from_file(str(folder / "tools.yaml"), Limits(timeout_s=3.0, memory_mb=256,
                                                                    max_output_bytes=4096), workers=2)
    finally:
        del os.environ["PORTAGRPO_TEST_SECRET"]
    yield box
    box.close()


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def run_one(box, text, context=None):
    counts = ToolCounts()
    [row] = box.answer([(text, context or {})], counts)
    return row, counts


def test_calculator_is_arithmetic_only():
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculator("2^10 + sqrt(16)") == "1028"
    for bad in ("__import__('os').system('true')", "9**9**9", "open('x')", "a + 1"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_gsm8k_checker_reuses_the_gsm8k_answer_reading():
    assert gsm8k("72", ground_truth="72").endswith("reward=1.0")
    assert gsm8k("#### 1,000", ground_truth="1000").endswith("reward=1.0")
    assert gsm8k("71", ground_truth="72").endswith("reward=0.0")


def test_tool_file_errors_are_one_sentence(tmp_path):
    bad = tmp_path / "t.yaml"
    bad.write_text("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n"
                   "    tool_schema: {function: {name: s}}\n")
    with pytest.raises(UserError, match=r"tools\[0\]\.class_name='verl.tools.search_tool.SearchTool' is not"):
        load_tool_config(bad)
    bad.write_text("tools: []\n")
    with pytest.raises(UserError, match="has no `tools:` list"):
        load_tool_config(bad)


def test_hermes_parsing():
    [ok] = parse_tool_calls('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
                            '</tool_call>')
    assert (ok.name, ok.arguments, ok.problem) == ("calculator", {"expression": "1+1"}, None)
    assert parse_tool_calls("The answer is 4.") == []
    [bad] = parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    assert "not valid JSON" in bad.problem
    [unclosed] = parse_tool_calls('<tool_call>{"name": "calculator"')
    assert "not closed" in unclosed.problem


def test_tool_turn_uses_the_template_and_cuts_long_results():
    from portagrpo.model.loading import build_char_tokenizer

    turns = ToolTurns(build_char_tokenizer(), max_tokens=40)
    assert turns.render(["42"]) == "\nt:42\na:"
    long = turns.render(["y" * 500])
    assert long.endswith("[output truncated]\na:") and long.count("y") < 40

    class Plain:
        chat_template = None
        eos_token = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

        def decode(self, ids):
            return "".join(map(chr, ids))

    assert ToolTurns(Plain(), 40).render(["42"]) == "\n<tool_response>\n42\n</tool_response>\n"


def test_builtins_run_in_the_sandbox(toolbox):
    text = call("calculator", expression="99999999*99999999") + call("python", code="print(6*7)")
    row, counts = run_one(toolbox, text)
    assert [r.text for r in row] == [str(99999999**2), "42\n"] and counts.errors == 0
    row, _ = run_one(toolbox, call("calc_gsm8k_reward", answer="18"), {"ground_truth": "18"})
    assert row[0].text.endswith("reward=1.0") and row[0].error is None


@pytest.mark.parametrize("text, kind, words", [
    ("<tool_call>{not json}</tool_call>", "parse", "not valid JSON"),
    (call("nope"), "unknown_tool", "there is no tool 'nope'"),
    (call("boom", x="three"), "arguments", "must be a JSON integer"),
    (call("boom", x=3), "exception", "RuntimeError: boom 3"),
    (call("hang"), "timeout", "limit and was stopped"),
    (call("sleeper"), "timeout", "limit and was stopped"),
    (call("crash"), "crash", "SIGSEGV"),
    (call("shout"), "output", "[output truncated]"),
    (call("hog"), "memory", "memory limit"),
    # a (bounded) fork bomb: 64 processes that each wait
    (call("python", code="import os, time\nfor _ in range(6):\n    os.fork()\ntime.sleep(600)"), "timeout", "stopped"),
])
def test_every_abuse_is_a_counted_tool_error(toolbox, text, kind, words):
    row, counts = run_one(toolbox, text)
    [result] = row
    assert result.error == kind and words in result.text
    assert counts.calls == 1 and counts.errors == 1 and counts.timeouts == (result.error == "timeout")
    if kind == "output":
        assert len(result.text) < 4096 + 100
    # the sandbox still answers the next call
    row, counts = run_one(toolbox, call("calculator", expression="2+2"))
    assert row[0].text == "4" and counts.errors == 0


def test_no_secrets_a_private_tmp_and_no_network(toolbox, tmp_path):
    """What a call sees at either isolation level (tests/unit/test_sandbox_isolation.py has the abuse suite of the
    namespaces level): no secret, a fresh working directory that is gone after the call, no network."""
    row, _ = run_one(toolbox, call("env"))
    seen = json.loads(row[0].text)
    assert seen["secret"] is None and set(seen["keys"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE"}
    if toolbox.sandbox.isolation.level == "namespaces":
        assert seen["cwd"] == "/tmp"
    else:
        assert os.path.basename(seen["cwd"]).startswith("portagrpo-tool-") and not os.path.exists(seen["cwd"])
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 53))\nprint('connected')"
    row, counts = run_one(toolbox, call("python", code=code))
    if row[0].network_isolated:
        assert row[0].error == "exception" and "connected" not in row[0].text
    row, counts = run_one(toolbox, call("write_outside", path=str(tmp_path / "out.txt")))
    if toolbox.sandbox.isolation.level == "namespaces":  # the host's files are not there to write
        assert row[0].error == "exception" and not (tmp_path / "out.txt").exists()


def test_a_fork_storm_leaves_no_process(toolbox):
    row, counts = run_one(toolbox, call("storm"))
    assert row[0].error == "timeout" and counts.timeouts == 1
    pgid = int(row[0].text.split()[0]) if row[0].text.split()[0].isdigit() else None
    if pgid is not None:
        for _ in range(50):
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("processes of the stopped call are still alive")


def test_a_tool_that_cannot_load_is_one_sentence_at_start(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n\ndef f():\n    return 1\n")
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"callable": "broken.py:f", "tool_schema": _schema("f")}]}))
    box = Toolbox.from_file(str(path), Limits(timeout_s=3.0), workers=1)
    with pytest.raises(UserError, match="a tool cannot be loaded in a tool worker: f: ModuleNotFoundError"):
        box.sandbox.start()
    box.close()


def test_both_time_limits_read_as_one_timeout():
    """A busy tool is stopped by whichever timer fires first (the wall clock or RLIMIT_CPU's SIGXCPU); on a quiet,
    fast machine that is the CPU timer. Both are the same counted outcome with the same words."""
    import signal

    from portagrpo.agent.sandbox import _outcome

    limits = Limits(timeout_s=3.0)
    by_cpu = _outcome("", int(signal.SIGXCPU), b"", over=False, late=False, limits=limits)
    by_wall = _outcome("", 0, b"", over=False, late=True, limits=limits)
    assert by_cpu[1] == by_wall[1] == "timeout"
    assert "limit and was stopped" in by_cpu[0] and "limit and was stopped" in by_wall[0]
    assert _outcome("", int(signal.SIGSEGV), b"", over=False, late=False, limits=limits)[1] == "crash"

"""A tool file is checked when the config loads, and by `train --dry-run`: every wrong type, a boolean written as a
string, a binary or non-YAML file, a key no tool reads, and more tool workers than the machine takes are each one
sentence naming the field and the fix. Nothing is written."""
import json
from pathlib import Path

import pytest
import yaml
from test_refusals import one_error, snapshot  # the house's one-sentence and nothing-changed checks

from portagrpo.agent.tools import max_tool_workers
from portagrpo.cli import main
from portagrpo.config.tool_file import load_tool_config
from portagrpo.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
MT = "rollout.multi_turn"


def schema(name="calculator", parameters=None):
    params = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    return {"type": "function", "function": {"name": name, "parameters": params if parameters is None else parameters}}


def entry(**changes):
    e = {"class_name": "calculator", "config": {"type": "native"}, "tool_schema": schema()}
    e.update(changes)
    return {key: value for key, value in e.items() if value is not None}


def dry_run(capsys, tools: Path, *overrides):
    code = main(["train", "--dry-run", f"{MT}.enable=true", f"{MT}.tool_config_path={tools}", *overrides])
    return code, capsys.readouterr()


BAD = [
    ({"tools": [entry(tool_schema=schema(parameters="expression"))]},
     "tools[0].tool_schema.function.parameters='expression' is a string; give a mapping"),
    ({"tools": [entry(tool_schema=schema(parameters={"properties": ["expression"]}))]},
     "tools[0].tool_schema.function.parameters.properties=['expression'] is a list; give a mapping"),
    ({"tools": [entry(tool_schema=schema(parameters={"properties": {"expression": {"type": "string"}},
                                                     "required": "expression"}))]},
     "parameters.required='expression' must be a list of argument names, such as [expression]"),
    ({"tools": [entry(tool_schema=schema(parameters={"properties": {"x": {"type": "string"}}, "required": ["y"]}))]},
     "parameters.required names 'y', which properties does not declare"),
    ({"tools": [entry(tool_schema=schema(parameters={"properties": {"x": {"type": "str"}}}))]},
     "properties.x.type='str' is not a JSON type; use one of string, integer"),
    ({"tools": [entry(tool_schema=schema(parameters={"type": "array"}))]}, "parameters.type='array' must be 'object'"),
    ({"tools": [entry(config=5)]}, "tools[0].config=5 is an integer; give a mapping"),
    ({"tools": [entry(class_name=None, callable="os:getcwd", config=5)]}, "tools[0].config=5 is an integer"),
    ({"tools": [entry(class_name=None, callable="os:getcwd", config={"network": "false"})]},
     "tools[0].config.network='false' is a string, not a boolean; write network: true or network: false"),
    ({"tools": [entry(config={"network": True})]}, "config.network=true: a built-in tool never gets the network"),
    ({"tools": [entry(config={"timeout": 3})]}, "tools[0].config has an unknown key 'timeout'"),
    ({"tools": [entry(config={"type": "mcp"})]}, "config.type='mcp' is not supported"),
    ({"tools": [entry(class_name=None, callable="os:getcwd", config={"builtin": "python"})]},
     "tools[0].config has an unknown key 'builtin'"),
    ({"tools": [entry(clas_name="calculator")]}, "unknown key 'clas_name'; did you mean 'class_name'?"),
    ({"tools": [entry(callable="os:getcwd")]}, "gives both class_name and callable"),
    ({"tools": [entry(class_name=None)]}, "tools[0] gives neither class_name nor callable"),
    ({"tools": [entry(tool_schema={"function": "calculator"})]}, "tools[0].tool_schema has no function mapping"),
    ({"tools": [entry(tool_schema=schema(name=""))]}, "tool_schema.function.name='' is not a name"),
    ({"tools": [entry(), entry()]}, "tools[1] repeats the name 'calculator'"),
    ({"tools": ["calculator"]}, "tools[0] is a string, not a mapping"),
    ({"tools": []}, "has no `tools:` list"),
]


@pytest.mark.parametrize("content,expected", BAD, ids=[e for _, e in BAD])
def test_a_bad_tool_file_is_one_sentence_at_load_and_in_the_dry_run(tmp_path, capsys, content, expected):
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump(content))
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="^" + MT) as err:
        load_tool_config(tools)
    assert expected in str(err.value) and "\n" not in str(err.value)
    code, out = dry_run(capsys, tools)
    assert code == 2 and expected in one_error(out.err) and "config OK" not in out.out
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("raw,expected", [
    (b"\x00\x01\xff\xfe" * 100, "is not a text file (byte 2 is not UTF-8)"),
    (b"tools:\n  - class_name: calculator\xff\n", "is not a text file"),
    (b"tools: [\n", "is not valid YAML (expected the node content, but found '<stream end>' at line 2)"),
    (b"tools:\n  - class_name: calculator\n    class_name: python\n", "key 'class_name' appears twice"),
    (b"tools:\n  - " + b"[" * 5_000, "is not valid YAML (nested thousands of levels deep)"),
    (b"just text\n", "has no `tools:` list"),
    (b"", "has no `tools:` list"),
])
def test_a_binary_or_non_yaml_tool_file_is_one_sentence(tmp_path, capsys, raw, expected):
    tools = tmp_path / "tools.yaml"
    tools.write_bytes(raw)
    with pytest.raises(UserError, match="^" + MT):
        load_tool_config(tools)
    code, out = dry_run(capsys, tools)
    assert code == 2 and expected in one_error(out.err)
    assert tools.read_bytes() == raw


def test_a_directory_or_a_huge_file_is_one_sentence(tmp_path, capsys):
    code, out = dry_run(capsys, tmp_path)
    assert code == 2 and "is a directory; give the path of a YAML tool file" in one_error(out.err)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (2 << 20))
    code, out = dry_run(capsys, huge)
    assert code == 2 and "over the 1 MiB a tool file may have" in one_error(out.err)


def test_every_problem_of_a_file_is_listed_at_once(tmp_path, capsys):
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [entry(config=5), entry(tool_schema=schema("b", parameters="x"))]}))
    code, out = dry_run(capsys, tools)
    assert code == 2 and "tools[0].config=5" in out.err and "tools[1].tool_schema.function.parameters='x'" in out.err


def test_too_many_tool_workers_is_one_sentence_naming_the_machine(tmp_path, capsys):
    """The bound is the machine's: a dry run (often away from the cluster) says it, the run that starts here stops
    on it before any worker starts, and a recipe for a bigger node still loads (tests/unit/test_config.py)."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [entry()]}))
    limit = max_tool_workers()
    sentence = (f"{MT}.tool_workers={limit + 1} is more than this machine takes: at most {limit}, 4 per CPU this "
                f"process may use")
    code, out = dry_run(capsys, tools, f"{MT}.tool_workers={limit + 1}")
    assert code == 0 and f"on this machine, a run would stop: {sentence}" in out.out
    code, out = dry_run(capsys, tools, f"{MT}.tool_workers={limit}")
    assert code == 0 and "config OK" in out.out and "would stop" not in out.out
    code, out = dry_run(capsys, tools, f"{MT}.tool_workers={limit}", "trainer.nproc_per_node=2",
                        "data.train_batch_size=4", "actor.ppo_mini_batch_size=8")  # every local rank starts its own
    assert code == 0 and (f"tool_workers={limit} on trainer.nproc_per_node=2 ranks is {2 * limit} workers, and is "
                          f"more than this machine takes") in out.out
    run = tmp_path / "run"
    code = main(["train", "--output-dir", str(run), f"{MT}.enable=true", f"{MT}.tool_config_path={tools}",
                 f"{MT}.tool_workers={limit + 1}", "trainer.total_steps=1", "trainer.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and sentence in err and "Traceback" not in err and not run.exists()


def test_the_recipes_tool_files_and_verls_load(tmp_path):
    for path in sorted((ROOT / "configs" / "tools").glob("*.yaml")):
        assert load_tool_config(path)
    verl = {"class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
            "config": {"sandbox_fusion_url": "http://localhost:8080/run_code", "num_workers": 10, "rate_limit": 10,
                       "enable_global_rate_limit": True, "default_timeout": 30, "default_language": "python",
                       "memory_limit_mb": 1024, "type": "native"},
            "tool_schema": schema("code_interpreter", {"type": "object", "properties": {"code": {"type": "string"}},
                                                       "required": ["code"]})}
    tools = tmp_path / "verl.yaml"
    tools.write_text(json.dumps({"tools": [verl]}))
    assert load_tool_config(tools)["code_interpreter"].target == "builtin:python"


def test_tools_that_run_model_written_code_are_marked_untrusted(tmp_path):
    (tmp_path / "mine.py").write_text("def f(x):\n    return x\n")
    tools = [entry(class_name=name, tool_schema=schema(name.rsplit(".", 1)[-1])) for name in
             ("calculator", "python", "gsm8k", "verl.tools.gsm8k_tool.Gsm8kTool",
              "verl.tools.sandbox_fusion_tools.SandboxFusionTool")]
    tools.append(entry(class_name=None, callable="mine.py:f", config={"network": True}, tool_schema=schema("f")))
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    specs = load_tool_config(path)
    assert {name for name, s in specs.items() if s.untrusted} == {"python", "SandboxFusionTool"}
    assert [name for name, s in specs.items() if s.network] == ["f"]  # a real boolean, on a tool of the user's

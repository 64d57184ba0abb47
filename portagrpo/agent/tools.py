"""Tools a model may call during a multi-turn rollout: the YAML tool file, the built-ins, and argument checks.

The tool file is verl's `tool_config_path` layout:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool      # or `callable: module:function | path/file.py:function`
        config: {type: native}
        tool_schema:
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {type: object, properties: ...}}

A tool is a plain function called with the call's arguments as keywords; it may also take `ground_truth`
(the sample's) by naming it. Its return value becomes the tool turn's text. Tools run in the sandbox
(agent/sandbox.py), never in the trainer's process.
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from portagrpo.errors import UserError
from portagrpo.fileio import UniqueKeyLoader, shorten

# verl's tool classes and our built-ins: the class name (or built-in name) -> "builtin:<name>"
BUILTIN_ALIASES = {
    "calculator": "calculator",
    "python": "python",
    "gsm8k": "gsm8k",
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "python",
}
SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
UNTRUSTED_BUILTINS = frozenset({"python"})  # built-ins that run code the model wrote
FIELD = "rollout.multi_turn.tool_config_path"
ENTRY_KEYS = ("class_name", "callable", "config", "tool_schema")
# `config` keys: `type` is verl's (`native` only), `builtin` picks a built-in by name, `network` (a user tool's)
CONFIG_KEYS = ("type", "builtin", "network")
# verl's SandboxFusionTool settings, accepted so its tool file loads unchanged; the sandbox's limits are
# rollout.multi_turn.tool_timeout_s and tool_memory_mb, not these (docs/config.md)
SANDBOX_FUSION_KEYS = ("sandbox_fusion_url", "num_workers", "enable_global_rate_limit", "rate_limit",
                       "default_timeout", "default_language", "memory_limit_mb")
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "object": (dict,), "array": (list,), "null": (type(None),)}
MAX_TOOL_FILE_BYTES = 1 << 20
TOOL_WORKERS_PER_CPU = 4  # sandbox workers mostly wait on their tool's process; more than this per CPU only queue


@dataclass(frozen=True)
class ToolSpec:
    name: str
    target: str  # "builtin:<name>", "module:function" or "/abs/path/file.py:function"
    schema: dict = field(default_factory=dict)  # the OpenAI function schema (`tool_schema`)
    network: bool = False  # True: the tool keeps the network (a user tool whose config says `network: true`)
    untrusted: bool = False  # True: the tool runs code the model wrote (the `python` built-in, verl's SandboxFusion)

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters", {}) or {}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else os.cpu_count())."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_tool_workers() -> int:
    """The most sandbox workers `rollout.multi_turn.tool_workers` may ask for on this machine."""
    return TOOL_WORKERS_PER_CPU * usable_cpus()


def tool_workers_problem(workers: int, ranks: int = 1) -> str | None:
    """Why `rollout.multi_turn.tool_workers` on `ranks` local ranks (each starts its own) is too many for this machine,
    or None."""
    if workers * ranks <= max_tool_workers():
        return None
    total = f" on trainer.nproc_per_node={ranks} ranks is {workers * ranks} workers, and" if ranks > 1 else ""
    return (f"rollout.multi_turn.tool_workers={workers}{total} is more than this machine takes: at most "
            f"{max_tool_workers()}, {TOOL_WORKERS_PER_CPU} per CPU this process may use ({usable_cpus()}, "
            f"os.sched_getaffinity); lower it.")


def tool_file_problems(path: str | Path) -> list[str]:
    """Every problem of a tool file, one sentence each (config validation and `--dry-run` list them with the rest)."""
    try:
        load_tool_config(path)
    except UserError as err:
        return str(err).splitlines()
    return []


def load_tool_config(path: str | Path) -> dict[str, ToolSpec]:
    """The tools a YAML tool file declares, by name. A bad file is refused with one sentence per problem (all of them
    at once), each naming the entry's field and the fix."""
    path = Path(path)
    entries = _read_entries(path)
    specs: dict[str, ToolSpec] = {}
    problems: list[str] = []
    for i, entry in enumerate(entries):
        spec = _tool_entry(entry, f"{FIELD}: tools[{i}]", path, problems)
        if spec is not None and spec.name in specs:
            problems.append(f"{FIELD}: tools[{i}] repeats the name {spec.name!r}; give every tool its own name.")
        elif spec is not None:
            specs[spec.name] = spec
    if problems:
        raise UserError("\n".join(problems))
    return specs


def _read_entries(path: Path) -> list:
    """The file's `tools:` list; a directory, a binary file, bad YAML or a key given twice is one sentence."""
    import yaml

    where = f"{FIELD}={shorten(str(path))!r}"
    try:
        if path.is_file() and path.stat().st_size > MAX_TOOL_FILE_BYTES:
            raise UserError(f"{where} is {path.stat().st_size} bytes, over the {MAX_TOOL_FILE_BYTES >> 20} MiB a tool "
                            f"file may have; give the YAML tool file itself.")
        text = path.read_bytes().decode("utf-8")
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader subclass
    except IsADirectoryError:
        raise UserError(f"{where} is a directory; give the path of a YAML tool file.") from None
    except OSError as err:
        raise UserError(f"{where} cannot be read ({err.strerror or type(err).__name__}); give a readable YAML tool "
                        f"file.") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{where} is not a text file (byte {err.start} is not UTF-8); give a YAML tool file with a "
                        f"`tools:` list.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        why = " ".join(str(getattr(err, "problem", None) or type(err).__name__).split())
        raise UserError(f"{where} is not valid YAML ({shorten(why)}{f' at line {mark.line + 1}' if mark else ''}); "
                        f"fix the file (its layout is in docs/config.md).") from None
    except RecursionError:
        raise UserError(f"{where} is not valid YAML (nested thousands of levels deep); fix the file.") from None
    except ValueError as err:  # an integer longer than Python converts
        raise UserError(f"{where} holds a value YAML cannot read ({shorten(str(err), 60)}); fix the file.") from None
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where} has no `tools:` list; declare at least one tool (see docs/config.md).")
    return entries


def _tool_entry(entry: Any, where: str, path: Path, problems: list[str]) -> ToolSpec | None:
    """The entry's ToolSpec, or None with its problems added to `problems`."""
    if not isinstance(entry, dict):
        problems.append(f"{where} is {_kind(entry)}, not a mapping; give class_name or callable, and "
                        f"tool_schema.")
        return None
    found = _unknown_keys(entry, ENTRY_KEYS, where) + _schema_problems(entry.get("tool_schema"), where)
    config = entry.get("config")
    if config is not None and not isinstance(config, dict):
        found.append(f"{where}.config={shorten(repr(config))} is {_kind(config)}; give a mapping, such as "
                     f"{{type: native}}, or leave config out.")
        config = None
    config = config or {}
    if "callable" in entry and "class_name" in entry:
        found.append(f"{where} gives both class_name and callable; keep the one that names the tool's code.")
    if "callable" in entry:
        target = _callable_target(entry["callable"], where, path, found)
    else:
        target = _builtin_target(entry.get("class_name"), config, where, found)
    found += _config_problems(config, where, builtin="callable" not in entry,
                              verl_sandbox=entry.get("class_name") == SANDBOX_FUSION)
    problems.extend(found)
    if found or target is None:
        return None
    name = entry["tool_schema"]["function"]["name"]
    builtin = target.removeprefix("builtin:") if target.startswith("builtin:") else None
    return ToolSpec(name, target, entry["tool_schema"], network=config.get("network", False) is True,
                    untrusted=builtin in UNTRUSTED_BUILTINS)


def _callable_target(target: Any, where: str, path: Path, problems: list[str]) -> str | None:
    module, _, function = target.rpartition(":") if isinstance(target, str) else ("", "", "")
    if not module or not function:
        problems.append(f"{where}.callable={shorten(repr(target))} is not module:function or path/file.py:function; "
                        f"name the tool's function that way.")
        return None
    if not module.endswith(".py"):
        return target
    file = Path(module) if Path(module).is_absolute() else (path.parent / module)
    if not file.is_file():
        problems.append(f"{where}.callable={target!r}: the file {str(file)!r} does not exist; give a path relative "
                        f"to the tool file, or an absolute one.")
        return None
    return f"{file.resolve()}:{function}"


def _builtin_target(cls: Any, config: dict, where: str, problems: list[str]) -> str | None:
    """A built-in by class_name, or by config.builtin (verl's own class names for a tool portagrpo builds in)."""
    names = [n for n in (cls, config.get("builtin")) if isinstance(n, str) and n in BUILTIN_ALIASES]
    if names:
        return f"builtin:{BUILTIN_ALIASES[names[0]]}"
    if cls is None:
        problems.append(f"{where} gives neither class_name nor callable; name a built-in tool "
                        f"({', '.join(sorted(BUILTIN_ALIASES))}) or callable: module:function.")
    else:
        problems.append(f"{where}.class_name={shorten(repr(cls))} is not a portagrpo tool; use one of "
                        f"{', '.join(sorted(BUILTIN_ALIASES))}, or give callable: module:function.")
    return None


def _kind(value: Any) -> str:
    """`value`'s YAML kind with its article: 'a string', 'an integer', 'a list'."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _unknown_keys(mapping: dict, known: tuple[str, ...], where: str) -> list[str]:
    problems = []
    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"{where} has an unknown key {shorten(repr(key), 40)}; {hint}the keys are "
                            f"{', '.join(known)}.")
    return problems


def _schema_problems(schema: Any, where: str) -> list[str]:
    """tool_schema: {type: function, function: {name, description, parameters}}, with the types argument checks use."""
    where = f"{where}.tool_schema"
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict):
        return [f"{where} has no function mapping; give tool_schema: {{type: function, function: {{name: ..., "
                f"description: ..., parameters: {{...}}}}}}."]
    where = f"{where}.function"
    problems = []
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append(f"{where}.name={shorten(repr(name))} is not a name; give the name the model calls the tool "
                        f"by, a non-empty string.")
    if not isinstance(fn.get("description", ""), str):
        problems.append(f"{where}.description is {_kind(fn['description'])}; give a string.")
    return problems + _parameters_problems(fn.get("parameters"), f"{where}.parameters")


def _parameters_problems(params: Any, where: str) -> list[str]:
    if params is None:
        return []
    if not isinstance(params, dict):
        return [f"{where}={shorten(repr(params))} is {_kind(params)}; give a mapping: {{type: object, "
                f"properties: {{NAME: {{type: string}}}}, required: [NAME]}}."]
    problems = []
    if params.get("type", "object") != "object":
        problems.append(f"{where}.type={shorten(repr(params['type']))} must be 'object' (a call's arguments are a "
                        f"JSON object).")
    props = params.get("properties")
    if props is not None and not isinstance(props, dict):
        problems.append(f"{where}.properties={shorten(repr(props))} is {_kind(props)}; give a mapping of "
                        f"argument names to {{type: ..., description: ...}}.")
        props = None
    for key, prop in (props or {}).items():
        problems += _property_problems(prop, f"{where}.properties.{shorten(str(key), 40)}")
    required = params.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        problems.append(f"{where}.required={shorten(repr(required))} must be a list of argument names, such as "
                        f"[{required if isinstance(required, str) else 'NAME'}].")
    elif required and props is not None:
        unknown = [r for r in required if r not in props]
        if unknown:
            problems.append(f"{where}.required names {', '.join(map(repr, unknown))}, which properties does not "
                            f"declare; declare it under properties or remove it from required.")
    return problems


def _property_problems(prop: Any, where: str) -> list[str]:
    if not isinstance(prop, dict):
        return [f"{where} is {_kind(prop)}; give a mapping such as {{type: string, description: ...}}."]
    kind = prop.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        return [f"{where}.type={shorten(repr(kind))} is not a JSON type; use one of {', '.join(JSON_TYPES)}."]
    return []


def _config_problems(config: dict, where: str, *, builtin: bool, verl_sandbox: bool) -> list[str]:
    where = f"{where}.config"
    known = CONFIG_KEYS if builtin else tuple(k for k in CONFIG_KEYS if k != "builtin")
    known += SANDBOX_FUSION_KEYS if verl_sandbox else ()
    problems = _unknown_keys(config, known, where)
    if "type" in config and config["type"] != "native":
        problems.append(f"{where}.type={shorten(repr(config['type']))} is not supported; portagrpo runs every tool "
                        f"in its own sandbox, so use type: native or leave it out.")
    network = config.get("network", False)
    if not isinstance(network, bool):
        problems.append(f"{where}.network={shorten(repr(network))} is {_kind(network)}, not a boolean; "
                        f"write network: true or network: false, without quotes.")
    elif network and builtin:
        problems.append(f"{where}.network=true: a built-in tool never gets the network; remove network, or give a "
                        f"callable tool of your own.")
    return problems


def resolve(target: str) -> Callable[..., Any]:
    """The function a tool's target names (imported in the sandbox worker, never in the trainer)."""
    if target.startswith("builtin:"):
        if target == "builtin:gsm8k":  # imported once in the worker, not in each call's limited process
            import portagrpo.rewards.functions  # noqa: F401
        return BUILTINS[target.split(":", 1)[1]]
    module, _, function = target.rpartition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"portagrpo_tool_{abs(hash(module))}", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise UserError(f"{target!r}: {module} has no function {function!r}.")
    return fn


def call_tool(fn: Callable[..., Any], arguments: dict, context: dict) -> str:
    """Call a tool with its arguments and the context keys it names (`ground_truth`); its result as text."""
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        names = {}
    extra = {k: v for k, v in context.items() if k in names and k not in arguments}
    result = fn(**arguments, **extra)
    if isinstance(result, str):
        return result
    return json.dumps(result, default=str)


def argument_problem(spec: ToolSpec, arguments: Any) -> str | None:
    """Why `arguments` do not fit the tool's parameter schema (required names, JSON types), or None."""
    if not isinstance(arguments, dict):
        return f"the arguments of {spec.name} must be a JSON object, not {type(arguments).__name__}"
    params = spec.parameters
    props = params.get("properties", {}) or {}
    missing = [k for k in params.get("required", []) or [] if k not in arguments]
    if missing:
        return f"{spec.name} needs the argument(s) {', '.join(missing)}"
    if props:
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"{spec.name} takes no argument(s) {', '.join(unknown)}; it takes {', '.join(props)}"
    for key, value in arguments.items():
        kind = (props.get(key) or {}).get("type")
        allowed = JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed and (not isinstance(value, allowed) or (kind in ("integer", "number") and isinstance(value, bool))):
            return f"the argument {key} of {spec.name} must be a JSON {kind}, not {type(value).__name__}"
    return None


# ---------------------------------------------------------------- built-ins

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
MAX_EXPONENT = 10_000  # a larger power is refused, not computed (9**9**9 would run for hours)
MAX_DIGITS = 10_000
MAX_EXPRESSION = 10_000  # characters


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"an exponent above {MAX_EXPONENT} is not computed")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 4:
            raise ValueError(f"a result over {MAX_DIGITS} digits is not computed")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
    raise ValueError(f"{type(node).__name__} is not arithmetic; use numbers, + - * / // % ** and "
                     f"{', '.join(_FUNCTIONS)}")


def calculator(expression: str) -> str:
    """Arithmetic on numbers (+ - * / // % **, sqrt, abs, round, min, max), parsed, never eval'd. Whatever the model
    writes, a failure is a ValueError with a short reason (told to the model), never another exception."""
    text = str(expression)
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"an expression over {MAX_EXPRESSION} characters is not computed")
    try:
        value = _evaluate(ast.parse(text.replace("^", "**"), mode="eval"))
    except SyntaxError:
        raise ValueError(f"cannot parse {shorten(text)!r} as arithmetic") from None
    except (RecursionError, MemoryError):  # parentheses or signs nested thousands deep
        raise ValueError("the expression is nested too deeply to compute") from None
    except (ArithmeticError, TypeError) as err:  # 1/0, 1e308**2, max() with no argument
        raise ValueError(f"{type(err).__name__}: {shorten(str(err))}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Runs `code` in this call's sandbox process: what it prints (to the process's stdout, which the sandbox reads
    up to its cap) is the result."""
    exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the sandbox is the isolation
    return ""


def gsm8k(answer: str, ground_truth: str | None = None) -> str:
    """verl's GSM8K checker: 1.0 when the answer, read as GSM8K's rewards read it, is the sample's."""
    from portagrpo.rewards.functions import extract_gsm8k_answer, normalize_number

    text = str(answer)
    predicted = extract_gsm8k_answer(text if "####" in text else f"#### {text}")
    right = ground_truth is not None and predicted is not None and predicted == normalize_number(str(ground_truth))
    return f"Current parsed answer={predicted} reward={1.0 if right else 0.0}"


BUILTINS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python, "gsm8k": gsm8k}

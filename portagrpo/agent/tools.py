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
import importlib
import importlib.util
import inspect
import json
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from portagrpo.errors import UserError

# verl's tool classes and our built-ins: the class name (or built-in name) -> "builtin:<name>"
BUILTIN_ALIASES = {
    "calculator": "calculator",
    "python": "python",
    "gsm8k": "gsm8k",
    "verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "python",
}
FIELD = "rollout.multi_turn.tool_config_path"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    target: str  # "builtin:<name>", "module:function" or "/abs/path/file.py:function"
    schema: dict = field(default_factory=dict)  # the OpenAI function schema (`tool_schema`)
    network: bool = False  # True: the tool keeps the network (a user tool that asks for it); built-ins never

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters", {}) or {}


def load_tool_config(path: str | Path) -> dict[str, ToolSpec]:
    """The tools a YAML tool file declares, by name; a bad file is one sentence naming the entry and the fix."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"{FIELD}={str(path)!r} cannot be read as YAML ({type(err).__name__}); give a file with a "
                        f"`tools:` list.") from None
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{FIELD}={str(path)!r} has no `tools:` list; declare at least one tool (see docs/config.md).")
    specs: dict[str, ToolSpec] = {}
    for i, entry in enumerate(entries):
        spec = _tool_entry(entry, i, path)
        if spec.name in specs:
            raise UserError(f"{FIELD}: tools[{i}] repeats the name {spec.name!r}; give every tool its own name.")
        specs[spec.name] = spec
    return specs


def _tool_entry(entry: Any, i: int, path: Path) -> ToolSpec:
    where = f"{FIELD}: tools[{i}]"
    if not isinstance(entry, dict):
        raise UserError(f"{where} is not a mapping; give class_name or callable, and tool_schema.")
    schema = entry.get("tool_schema") or {}
    fn = schema.get("function") if isinstance(schema, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise UserError(f"{where} has no tool_schema.function.name; give the name the model calls it by.")
    config = entry.get("config") or {}
    if "callable" in entry:
        target = str(entry["callable"])
        module, _, function = target.rpartition(":")
        if not module or not function:
            raise UserError(f"{where}.callable={target!r} is not module:function or path/file.py:function.")
        if module.endswith(".py"):
            file = Path(module) if Path(module).is_absolute() else (path.parent / module)
            if not file.is_file():
                raise UserError(f"{where}.callable={target!r}: the file {str(file)!r} does not exist.")
            target = f"{file.resolve()}:{function}"
        return ToolSpec(name, target, schema, network=bool(config.get("network", False)))
    cls = entry.get("class_name")
    builtin = BUILTIN_ALIASES.get(str(cls)) or BUILTIN_ALIASES.get(str(config.get("builtin")))
    if builtin is None:
        raise UserError(f"{where}.class_name={cls!r} is not a portagrpo tool; use one of "
                        f"{', '.join(sorted(BUILTIN_ALIASES))}, or give callable: module:function.")
    return ToolSpec(name, f"builtin:{builtin}", schema)


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


JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "object": (dict,), "array": (list,), "null": (type(None),)}


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
    """Arithmetic on numbers (+ - * / // % **, sqrt, abs, round, min, max), parsed, never eval'd."""
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate(tree)
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

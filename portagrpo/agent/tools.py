"""Tools a model may call during a multi-turn rollout: resolving and calling them, the built-ins, and argument
checks. The tool file that declares them (verl's `tool_config_path` layout) is read and checked in
config/tool_file.py.

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
import os
from typing import Any, Callable

from portagrpo.config.tool_file import JSON_TYPES, ToolSpec
from portagrpo.errors import UserError
from portagrpo.fileio import shorten

TOOL_WORKERS_PER_CPU = 4  # sandbox workers mostly wait on their tool's process; more than this per CPU only queue


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else os.cpu_count())."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_tool_workers() -> int:
    """The most sandbox workers `rollout.multi_turn.tool_workers` may ask for on this machine."""
    return TOOL_WORKERS_PER_CPU * usable_cpus()


def tool_workers_problem(workers: int, ranks: int = 1, field: str = "rollout.multi_turn.tool_workers") -> str | None:
    """Why `workers` sandbox workers (`field`) on `ranks` local ranks (each starts its own) are too many for this
    machine, or None."""
    if workers * ranks <= max_tool_workers():
        return None
    total = f" on trainer.nproc_per_node={ranks} ranks is {workers * ranks} workers, and" if ranks > 1 else ""
    return (f"{field}={workers}{total} is more than this machine takes: at most "
            f"{max_tool_workers()}, {TOOL_WORKERS_PER_CPU} per CPU this process may use ({usable_cpus()}, "
            f"os.sched_getaffinity); lower it.")


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
    up to its cap) is the result. A program that ends with `sys.exit()`, `exit(0)` or `quit()` ended well, as
    Python's own interpreter says by its status 0; another exit status is the program's failure."""
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the sandbox is the isolation
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    return ""


def gsm8k(answer: str, ground_truth: str | None = None) -> str:
    """verl's GSM8K checker: 1.0 when the answer, read as GSM8K's rewards read it, is the sample's."""
    from portagrpo.rewards.functions import extract_gsm8k_answer, normalize_number

    text = str(answer)
    predicted = extract_gsm8k_answer(text if "####" in text else f"#### {text}")
    right = ground_truth is not None and predicted is not None and predicted == normalize_number(str(ground_truth))
    return f"Current parsed answer={predicted} reward={1.0 if right else 0.0}"


BUILTINS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python, "gsm8k": gsm8k}

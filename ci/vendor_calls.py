"""The project's own calls into its vendors (vLLM, torch_npu, torch.distributed), read from its source by AST, never
imported: what `ci/vendor_surface.py` records the vendors' side of, and what tests/unit/test_vendor_surface.py checks
against it.

A call is kept when its callee resolves to a vendor name: a name imported from a vendor (`import torch.distributed as
dist`, `from vllm.inputs import TokensPrompt`), a vendor module's own name used as a value (`vllm` handed to a
function), a local alias of a vendor attribute (`fused_op = torch_npu.npu_fusion_attention`), or an attribute that
RECEIVERS says holds a vendor object (`self.llm`: a `vllm.LLM`). Its keywords are the explicit ones, and those of a
`**mapping` whose keys can be read: a dict literal or `dict(...)` assigned in the same function, or what a project
function returns (its dict literal, `d["key"] = ...` and `d.update(key=...)`), followed through the project's
functions by name. A call inside `try: ... except (AttributeError|TypeError|ImportError)` or in a function that asks
`hasattr`/`getattr` for the callee's last name is marked guarded: the project expects it may be missing.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

VENDOR_ROOTS = ("vllm", "torch_npu", "torch.distributed")
SOURCES = ("portagrpo", "backends", "kernels")
# attributes that hold a vendor object, by the source text of the receiver (rollout/vllm.py builds them)
RECEIVERS = {"self.llm": "vllm.LLM", "self._sampling_cls": "vllm.SamplingParams"}
GUARDS = {"AttributeError", "TypeError", "ImportError", "ModuleNotFoundError", "NotImplementedError"}


@dataclass
class VendorCall:
    symbol: str  # the vendor's dotted name: a function, a class (its constructor) or a class's method
    keywords: set[str] = field(default_factory=set)
    open_keywords: bool = False  # a **mapping whose keys could not all be read
    guarded: bool = False
    where: str = ""

    @property
    def vendor(self) -> str:
        return next(root for root in VENDOR_ROOTS if self.symbol == root or self.symbol.startswith(root + "."))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _is_vendor(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in VENDOR_ROOTS)


class _Functions:
    """Every project function by its bare name (the keys of the dict it returns, for `**f(...)`)."""

    def __init__(self, trees: dict[str, ast.Module]) -> None:
        self.by_name: dict[str, list[ast.FunctionDef]] = {}
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.by_name.setdefault(node.name, []).append(node)

    def returned_keys(self, name: str, seen: frozenset = frozenset()) -> set[str] | None:
        found = self.by_name.get(name)
        if not found or len(found) != 1 or name in seen:
            return None
        return _dict_keys_of_function(found[0], self, seen | {name})


def _keys_of(value: ast.AST, fn: ast.AST | None, functions: _Functions, seen: frozenset) -> set[str] | None:
    """The keys of a mapping expression, or None where they cannot all be read."""
    if isinstance(value, ast.Dict):
        keys: set[str] = set()
        for k, v in zip(value.keys, value.values):
            if k is None:  # {**other}
                inner = _keys_of(v, fn, functions, seen)
                if inner is None:
                    return None
                keys |= inner
            elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                keys.add(k.value)
            else:
                return None
        return keys
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict" and not value.args:
        keys = set()
        for kw in value.keywords:
            if kw.arg is None:
                inner = _keys_of(kw.value, fn, functions, seen)
                if inner is None:
                    return None
                keys |= inner
            else:
                keys.add(kw.arg)
        return keys
    if isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute)):
        name = value.func.id if isinstance(value.func, ast.Name) else value.func.attr
        return functions.returned_keys(name, seen)
    if isinstance(value, ast.Name) and fn is not None:
        return _local_keys(fn, value.id, functions, seen)
    if isinstance(value, ast.IfExp):
        a, b = _keys_of(value.body, fn, functions, seen), _keys_of(value.orelse, fn, functions, seen)
        return None if a is None or b is None else a | b
    return None


def _local_keys(fn: ast.AST, name: str, functions: _Functions, seen: frozenset) -> set[str] | None:
    """Keys a local mapping `name` can hold in `fn`: its assignments, `name[k] = ...` and `name.update(k=...)`."""
    keys: set[str] = set()
    assigned = False
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == name and node.value is not None:
                    inner = _keys_of(node.value, fn, functions, seen)
                    if inner is None:
                        return None
                    keys |= inner
                    assigned = True
                elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                      and target.value.id == name):
                    if not (isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                        return None
                    keys.add(target.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == name):
            for kw in node.keywords:
                if kw.arg is None:
                    return None
                keys.add(kw.arg)
            for arg in node.args:
                inner = _keys_of(arg, fn, functions, seen)
                if inner is None:
                    return None
                keys |= inner
    return keys if assigned else None


def _dict_keys_of_function(fn: ast.FunctionDef, functions: _Functions, seen: frozenset) -> set[str] | None:
    keys: set[str] = set()
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return None
    for ret in returns:
        inner = _keys_of(ret.value, fn, functions, seen)
        if inner is None:
            return None
        keys |= inner
    return keys


class _FileCalls(ast.NodeVisitor):
    def __init__(self, path: str, functions: _Functions) -> None:
        self.path, self.functions = path, functions
        self.imported: dict[str, str] = {}  # local name -> vendor dotted name
        self.calls: list[VendorCall] = []
        self.stack: list[ast.AST] = []  # enclosing functions
        self.guards: list[bool] = []  # enclosing try blocks that expect a missing name

    # -- names
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_vendor(alias.name):
                self.imported[alias.asname or alias.name] = alias.name
            elif alias.name == "torch" and alias.asname is None:
                self.imported.setdefault("torch", "torch")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_vendor(full):
                    self.imported[alias.asname or alias.name] = full

    def _resolve(self, expr: ast.AST) -> str | None:
        text = _dotted(expr)
        if text is None:
            return None
        for receiver, vendor in RECEIVERS.items():
            if text == receiver or text.startswith(receiver + "."):
                return vendor + text[len(receiver):]
        head, _, rest = text.partition(".")
        if head in self.imported:
            full = self.imported[head] + (f".{rest}" if rest else "")
        elif head in ("vllm", "torch_npu"):
            full = text
        elif self.stack and head in self._aliases(self.stack[-1]):
            full = self._aliases(self.stack[-1])[head] + (f".{rest}" if rest else "")
        else:
            return None
        return full if _is_vendor(full) and full not in VENDOR_ROOTS else None

    def _aliases(self, fn: ast.AST) -> dict[str, str]:
        out = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                text = _dotted(node.value)
                if text:
                    head, _, rest = text.partition(".")
                    base = self.imported.get(head) or (head if head in ("vllm", "torch_npu") else None)
                    if base:
                        out[node.targets[0].id] = base + (f".{rest}" if rest else "")
        return out

    # -- scopes
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.stack.append(node)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Try(self, node: ast.Try) -> None:
        names = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            names |= {k.id for k in kinds if isinstance(k, ast.Name)}
        self.guards.append(bool(names & GUARDS))
        for stmt in node.body:
            self.visit(stmt)
        self.guards.pop()
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def _asked_for(self, name: str) -> bool:
        if not self.stack:
            return False
        for node in ast.walk(self.stack[-1]):
            asks = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr",
                                                                                                    "getattr")
            if asks and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == name:
                return True
        return False

    def _parameter_keys(self, name: str) -> set[str] | None:
        """The keys of a mapping handed in as the enclosing function's parameter `name`: read where this file calls
        that function with a local mapping in its place."""
        fn = self.stack[-1] if self.stack else None
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        params = [a.arg for a in fn.args.args]
        if name not in params:
            return None
        index = params.index(name)
        keys: set[str] = set()
        found = False
        for caller in ast.walk(self.tree):
            if not isinstance(caller, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(caller):
                if not isinstance(call, ast.Call):
                    continue
                callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
                if callee != fn.name:
                    continue
                position = index - 1 if isinstance(call.func, ast.Attribute) and params[:1] == ["self"] else index
                given = next((kw.value for kw in call.keywords if kw.arg == name), None)
                if given is None and 0 <= position < len(call.args):
                    given = call.args[position]
                inner = None if given is None else _keys_of(given, caller, self.functions, frozenset())
                if inner is None:
                    return None
                keys |= inner
                found = True
        return keys if found else None

    def visit_Module(self, node: ast.Module) -> None:
        self.tree = node
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        symbol = self._resolve(node.func)
        if symbol is not None:
            call = VendorCall(symbol, where=f"{self.path}:{node.lineno}")
            for kw in node.keywords:
                if kw.arg is not None:
                    call.keywords.add(kw.arg)
                    continue
                keys = _keys_of(kw.value, self.stack[-1] if self.stack else None, self.functions, frozenset())
                if keys is None and isinstance(kw.value, ast.Name):
                    keys = self._parameter_keys(kw.value.id)
                if keys is None:
                    call.open_keywords = True
                else:
                    call.keywords |= keys
            call.guarded = any(self.guards) or self._asked_for(symbol.rsplit(".", 1)[-1])
            self.calls.append(call)
        self.generic_visit(node)


def project_calls(root: Path, sources: tuple[str, ...] = SOURCES) -> list[VendorCall]:
    """Every call of the project's source (under `root`) whose callee resolves to a vendor name."""
    trees = {}
    for folder in sources:
        for path in sorted((root / folder).rglob("*.py")):
            trees[str(path.relative_to(root))] = ast.parse(path.read_text(), filename=str(path))
    functions = _Functions(trees)
    calls = []
    for path, tree in trees.items():
        visitor = _FileCalls(path, functions)
        visitor.visit(tree)
        calls += visitor.calls
    return calls


def calls_in_text(text: str, root: Path, name: str = "<snippet>") -> list[VendorCall]:
    """The vendor calls of one piece of source (a test's deliberately wrong call), with the project's functions."""
    trees = {}
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            trees[str(path)] = ast.parse(path.read_text())
    visitor = _FileCalls(name, _Functions(trees))
    visitor.visit(ast.parse(text))
    return visitor.calls

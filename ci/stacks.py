#!/usr/bin/env python3
"""The support matrix (ci/matrix.yaml) as a tool:

    python ci/stacks.py render            # the Markdown table docs/backends.md shows
    python ci/stacks.py resolve [STACK..] # pip's resolver, without installing, for every stack
    python ci/stacks.py features STACK    # what a stack offers (fsdp2, vllm, ...), as JSON

`resolve` builds portagrpo's wheel, then asks `pip install --dry-run` for that stack's Python and
platform (`--only-binary=:all: --platform ... --python-version ...`) whether portagrpo and the stack's
exact pins resolve together. Packages the vendor image brings and PyPI cannot give for that platform
(a ROCm torch, vLLM built from source) are stood in by placeholder wheels of exactly that version
declaring the requirements the real package declares (see `provided` in the matrix), so a pin that
conflicts with them fails as it would in the image. Nothing is installed; pip reads PyPI's metadata.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "ci" / "matrix.yaml"
GLIBC = range(5, 40)  # manylinux_2_5 .. manylinux_2_39: pip matches --platform tags exactly, so name them all
PLATFORMS = {
    arch: [f"manylinux_2_{n}_{arch}" for n in GLIBC] + [f"manylinux2014_{arch}", f"manylinux2010_{arch}",
                                                          f"manylinux1_{arch}", f"linux_{arch}"]
    for arch in ("x86_64", "aarch64")
}
# Columns of the rendered table, in order: (heading, how to read it from a stack).
VERSIONED = ("torch", "torch-npu", "vllm", "vllm-ascend", "transformers", "peft", "ray")


def load(path: Path = MATRIX) -> dict:
    return yaml.safe_load(path.read_text())


def versions(stack: dict) -> dict[str, str]:
    """Every package version of a stack, resolved from PyPI or provided by the image."""
    out = {name: str(v) for name, v in (stack.get("packages") or {}).items()}
    out.update({name: str(p["version"]) for name, p in (stack.get("provided") or {}).items()})
    return out


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def features(stack: dict) -> dict[str, bool]:
    """What a stack offers the trainer, from its versions (the recipes test reads this)."""
    v = versions(stack)
    torch = _release(v["torch"])
    return {
        "fsdp2": torch >= (2, 6),  # fully_shard and MixedPrecisionPolicy public in torch.distributed.fsdp
        "fsdp2_native_sum": torch >= (2, 8),  # set_force_sum_reduction_for_comms; older torch: portagrpo's fallback
        "vllm": "vllm" in v,
        "vllm_ascend": "vllm-ascend" in v,
        "bf16": True,
        # trainer.parallel=ep: torchtitan 0.3.0's dispatcher imports torch.nn.attention.varlen (in the torch 2.10
        # wheel, not in 2.9's) and calls torch.compiler._is_non_strict_tracing at every token exchange (in the 2.12,
        # 2.13 and 2.14 wheels, not in 2.10's or 2.11's: model/expert_parallel.py ep_import_problem), and splits
        # transformers 5's packed experts
        "ep": torch >= (2, 12) and _release(v["transformers"]) >= (5, 0),
    }


# ---------------------------------------------------------------- render


def render(matrix: dict) -> str:
    head = ["stack", "kind", "Python", "runtime", *VERSIONED, "image"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in matrix["stacks"].items():
        v = versions(s)
        provided = set(s.get("provided") or {})
        cells = [f"`{name}`", s["kind"], s["python"], s["runtime"]]
        cells += [(v[p] + (" (image)" if p in provided else "")) if p in v else "–" for p in VERSIONED]
        cells.append(f"`{s['image']}`")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Where each version comes from:")
    lines.append("")
    for name, s in matrix["stacks"].items():
        cited = "; ".join(f"{k}: {t}" for k, t in s.get("sources", {}).items())
        lines.append(f"- `{name}`: {cited}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- resolve


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def placeholder_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel that installs nothing and declares `requires`: the image's own build of `name`."""
    dist = f"{_normal(name)}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: portagrpo-ci\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def build_portagrpo_wheel(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(folder),
                    str(ROOT)], check=True)
    return next(folder.glob("portagrpo-*.whl"))


def pip_command(stack: dict, wheel: Path, stubs: Path, target: Path, report: Path,
                overrides: dict[str, str] | None = None) -> list[str]:
    py = stack["python"].replace(".", "")
    pins = {**{k: str(v) for k, v in (stack.get("packages") or {}).items()}, **(overrides or {})}
    reqs = [f"{name}=={version}" for name, version in pins.items()]
    reqs += [f"{name}=={p['version']}" for name, p in (stack.get("provided") or {}).items()]
    extras = "[vllm]" if "vllm" in versions(stack) else ""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--only-binary=:all:", "--python-version", py, "--implementation", "cp",
           "--target", str(target), "--find-links", str(stubs), "--disable-pip-version-check"]
    for tag in PLATFORMS[stack["platform"]]:
        cmd += ["--platform", tag]
    return cmd + [f"portagrpo{extras} @ {wheel.as_uri()}", *reqs]


def resolve(name: str, stack: dict, wheel: Path, overrides: dict[str, str] | None = None) -> tuple[bool, str]:
    """(resolved, one line): whether portagrpo and the stack resolve together on its platform."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stubs = tmp / "stubs"
        stubs.mkdir()
        for pkg, p in (stack.get("provided") or {}).items():
            placeholder_wheel(stubs, pkg, str(p["version"]), list(p.get("requires") or []))
        report = tmp / "report.json"
        cmd = pip_command(stack, wheel, stubs, tmp / "target", report, overrides)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
            why = " / ".join(ln.strip() for ln in lines if "conflict" in ln.lower() or "requires" in ln.lower()
                             or "ERROR" in ln or "because" in ln)[:1200]
            return False, f"{name}: does not resolve: {why or lines[-1] if lines else 'pip failed'}"
        chosen = {_normal(i["metadata"]["name"]): i["metadata"]["version"]
                  for i in json.loads(report.read_text())["install"]}
        wanted = {_normal(k): v for k, v in versions(stack).items()}
        wanted.update({_normal(k): v for k, v in (overrides or {}).items()})
        wrong = {k: (chosen.get(k), v) for k, v in wanted.items() if chosen.get(k) != v}
        if wrong:  # the image's own build would be replaced
            return False, f"{name}: resolves but replaces the stack's own packages: {wrong}"
        return True, f"{name}: resolves ({len(chosen)} packages; portagrpo {chosen.get('portagrpo')})"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ci/stacks.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("render")
    r = sub.add_parser("resolve")
    r.add_argument("stacks", nargs="*")
    r.add_argument("--override", action="append", default=[], metavar="PKG==VER",
                   help="replace one pin (to show that a conflicting set fails)")
    f = sub.add_parser("features")
    f.add_argument("stack")
    args = p.parse_args(argv)
    matrix = load()
    if args.cmd == "render":
        print(render(matrix), end="")
        return 0
    if args.cmd == "features":
        print(json.dumps(features(matrix["stacks"][args.stack])))
        return 0
    names = args.stacks or list(matrix["stacks"])
    unknown = [n for n in names if n not in matrix["stacks"]]
    if unknown:
        print(f"unknown stack(s) {unknown}; known: {', '.join(matrix['stacks'])}", file=sys.stderr)
        return 2
    overrides = dict(o.split("==", 1) for o in args.override)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_portagrpo_wheel(Path(tmp))
        for name in names:
            ok, line = resolve(name, matrix["stacks"][name], wheel, overrides)
            print(("ok    " if ok else "FAIL  ") + line, flush=True)
            failed += not ok
    print(f"stacks: {len(names) - failed} resolve, {failed} do not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

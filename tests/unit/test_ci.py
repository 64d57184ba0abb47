"""The CI material no runner here can execute: lint it and check that its pins agree."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from portagrpo.backends import backend_names
from portagrpo.tools.parity import DTYPES

ROOT = Path(__file__).resolve().parents[2]
MATRIX = yaml.safe_load((ROOT / "ci" / "matrix.yaml").read_text())
WORKFLOW = ROOT / ".github" / "workflows" / "parity.yml"


def _arg_default(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.M)
    assert match, f"{dockerfile} has no ARG {name}=..."
    return match.group(1)


def test_matrix_entries_are_valid():
    stacks = MATRIX["stacks"]
    seen = set()
    for row in MATRIX["matrix"]:
        assert set(row) == {"backend", "dtype", "suite", "runner", "stack"}, row
        assert row["backend"] in backend_names() and row["dtype"] in DTYPES, row
        assert row["stack"] == "cpu" or stacks[row["stack"]]["vendor"] == row["backend"], row
        assert row["suite"] in {"parity", "unit"}, row
        seen.add(row["backend"])
    assert seen == {"cpu", "cuda", "rocm", "npu"}


@pytest.mark.parametrize("vendor", ["cuda", "rocm", "npu"])
def test_each_dockerfile_builds_on_its_vendors_stacks_and_never_replaces_the_image(vendor):
    stacks = {n: s for n, s in MATRIX["stacks"].items() if s["vendor"] == vendor}
    current = next(s for s in stacks.values() if s["kind"] == "current")
    dockerfile = ROOT / "ci" / "docker" / vendor / "Dockerfile"
    assert _arg_default(dockerfile, "BASE_IMAGE") == current["image"]
    text = dockerfile.read_text()
    for name, stack in stacks.items():  # the build command of every stack is written at the top
        assert f"BASE_IMAGE={stack['image']}" in text or stack is current, name
    # installed under a constraints file of everything the image holds: nothing of the vendor's is replaced
    install = re.search(r"^RUN (.+?)(?<!\\)$", text, re.M | re.S).group(1)
    assert "pip list --format=freeze --exclude-editable > /opt/portagrpo/image-constraints.txt" in install
    assert "pip install --no-cache-dir -c /opt/portagrpo/image-constraints.txt" in install
    assert "torch" not in install.split("-c /opt/portagrpo/image-constraints.txt", 1)[1]  # never asks for torch
    assert "vllm" not in install and f".[{vendor}" not in install  # no PyPI vLLM, no extra that adds Triton
    assert f"doctor\", \"--require\", \"{vendor}\"" in text or f"doctor --require {vendor}" in text  # health check
    assert "portagrpo" in text.split("ENTRYPOINT", 1)[1].splitlines()[0]


def test_the_rocm_extra_never_installs_pypi_triton():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("triton") for req in extras["rocm"])


def test_workflow_runs_every_matrix_backend_on_its_runner():
    wf = yaml.safe_load(WORKFLOW.read_text())
    jobs = wf["jobs"]
    assert jobs["cpu"]["runs-on"] == "ubuntu-latest"
    assert any("bash .ci/run" in str(step.get("run", "")) for step in jobs["cpu"]["steps"])
    include = jobs["accelerator"]["strategy"]["matrix"]["include"]
    built = {(e["stack"], e["backend"], e["base_image"]) for e in include}
    assert built == {(n, s["vendor"], s["image"]) for n, s in MATRIX["stacks"].items()}  # every stack, its image
    runners = {row["runner"] for row in MATRIX["matrix"] if row["backend"] != "cpu"}
    assert {e["backend"] for e in include} == runners == {"cuda", "rocm", "npu"}
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    assert set(labels) == runners
    assert jobs["accelerator"]["runs-on"] == ["self-hosted", "${{ matrix.backend }}"]
    steps = jobs["accelerator"]["steps"]
    assert any("--build-arg \"BASE_IMAGE=${{ matrix.base_image }}\"" in str(s.get("run", "")) for s in steps)
    assert any("ci/hardware-check.sh" in str(s.get("run", "")) for s in steps)
    uploads = [
        s for job in jobs.values() for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")
    ]
    assert len(uploads) == 2


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is not installed (test extra)")
def test_actionlint_accepts_the_workflow():
    res = subprocess.run(["actionlint", "-config-file", str(ROOT / ".github" / "actionlint.yaml"), str(WORKFLOW)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (test extra)")
@pytest.mark.parametrize("vendor", ["cuda", "rocm", "npu"])
def test_hadolint_accepts_the_dockerfiles(vendor):
    res = subprocess.run(
        ["hadolint", str(ROOT / "ci" / "docker" / vendor / "Dockerfile")], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_parity_script_is_strict_bash():
    text = (ROOT / "ci" / "parity.sh").read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(ROOT / "ci" / "parity.sh")]).returncode == 0


def test_every_subpackage_is_in_the_wheel():
    """pyproject lists packages explicitly: a new folder missing there works in an editable install
    and is absent from every built wheel and image."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    core = ROOT / "portagrpo"
    subpackages = {"portagrpo." + ".".join(p.parent.relative_to(core).parts)
                   for p in core.rglob("__init__.py") if p.parent != core}
    assert subpackages <= set(setup["packages"]), sorted(subpackages - set(setup["packages"]))


def test_the_code_passes_the_projects_lint_and_import_order():
    """`ruff check` with pyproject's [tool.ruff] settings (pyflakes, pycodestyle at 120 columns, import
    order, bugbear): the README's test command runs it, so CI does."""
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]

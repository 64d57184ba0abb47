"""portagrpo as the vendor images hold it: the tree each ci/docker/*/Dockerfile COPYs into its WORKDIR, built
into a wheel and installed NON-editable (CI's own environment installs editable, so it never meets what an
image meets), then started the way each image starts it, with the WORKDIR (a source tree) as the current
directory: the image's ENTRYPOINT with its CMD, the ENTRYPOINT with `train trainer.nproc_per_node=2` (ranks
start as `python -m portagrpo`, where the tree in the working directory must not hide the installed package),
and `portagrpo hardware-check cpu` with a relative OUT, as the parity workflow runs it from the WORKDIR.

The fresh venv sees this environment's dependencies through a .pth line naming this environment's
site-packages: a path listed in a .pth is appended to sys.path without that folder's own .pth files being
run, so this environment's editable portagrpo stays out (its other editable installs, the emu plugin, are
carried over by name), and `import portagrpo` resolves to the wheel's copy (checked first).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "ci" / "docker").glob("*/Dockerfile"))
QUICK = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.plot=false",
         "trainer.tensorboard=false", "trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "data.train_size=16", "data.val_size=4"]


def parse_dockerfile(path: Path) -> dict:
    """WORKDIR, the COPY lines (source, destination), the install RUN line, ENTRYPOINT and CMD (exec form)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    image = {"workdir": "/", "copies": [], "run": "", "entrypoint": [], "cmd": []}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if word == "WORKDIR":
            image["workdir"] = os.path.join(image["workdir"], rest)
        elif word == "COPY":
            *sources, dest = shlex.split(rest)
            assert not any(s.startswith("--") for s in sources), f"{path}: COPY flags are not modelled here"
            dest = os.path.normpath(os.path.join(image["workdir"], dest))
            into = len(sources) > 1 or rest.endswith("/")
            image["copies"] += [(s, os.path.join(dest, os.path.basename(s)) if into else dest) for s in sources]
        elif word == "RUN" and "pip install" in rest and "portagrpo" in rest:
            image["run"] = rest
        elif word in ("ENTRYPOINT", "CMD"):
            image[word.lower()] = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
    return image


def _image_tree(image: dict, root: Path) -> Path:
    """The image's filesystem, as far as its COPY lines make it, under `root`; returns its WORKDIR."""
    for source, dest in image["copies"]:
        src, target = ROOT / source, root / dest.lstrip("/")
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return root / image["workdir"].lstrip("/")


def _parent_pth_lines() -> list[str]:
    """This environment's site-packages as a path line, then its .pth files' lines but portagrpo's own
    editable install (its finder's .pth, or a path line naming this tree), so the emu plugin installed
    beside it stays importable and this tree does not."""
    site = Path(sysconfig.get_paths()["purelib"])
    lines = [str(site)]
    for pth in sorted(site.glob("*.pth")):
        if pth.name.startswith("__editable__.portagrpo-"):
            continue
        for line in pth.read_text().splitlines():
            if line.startswith(("import ", "import\t")):
                lines.append(line)
            elif line.strip() and not line.startswith("#") and (site / line.strip()).resolve() != ROOT:
                lines.append(str((site / line.strip()).resolve()))
    return lines


def _build_flags() -> list[str]:
    """`--no-build-isolation` where this environment has what pyproject's build-system asks for (setuptools
    >= 68, and bdist_wheel: built into setuptools 70.1+, else the wheel package); else pip builds in isolation
    (fetching them), as Python 3.11's bundled setuptools 65 without wheel would fail."""
    from importlib.metadata import PackageNotFoundError, version

    def at_least(dist: str, wanted: tuple[int, ...]) -> bool:
        try:
            parts = tuple(int(x) for x in re.findall(r"\d+", version(dist))[:len(wanted)])
        except PackageNotFoundError:
            return False
        return parts >= wanted

    has_bdist_wheel = at_least("setuptools", (70, 1)) or at_least("wheel", (0,))
    return ["--no-build-isolation"] if at_least("setuptools", (68,)) and has_bdist_wheel else []


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(argv: list[str], cwd: Path, venv: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(venv), capture_output=True, text=True, timeout=timeout)


def _said(res: subprocess.CompletedProcess) -> str:
    return f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-4000:]}"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """One installed wheel per distinct image tree: [(dockerfile, parsed image, WORKDIR here, venv)]."""
    assert DOCKERFILES, "no ci/docker/*/Dockerfile"
    built: dict[str, tuple[Path, Path]] = {}
    out = []
    for dockerfile in DOCKERFILES:
        image = parse_dockerfile(dockerfile)
        assert image["run"] and not re.search(r"\s-e\s|--editable", image["run"]), (
            f"{dockerfile}: the test models a non-editable install of the WORKDIR; its RUN line changed")
        key = json.dumps([image["workdir"], image["copies"]])
        if key not in built:
            base = tmp_path_factory.mktemp(f"image-{dockerfile.parent.name}")
            workdir = _image_tree(image, base / "fs")
            assert (workdir / "portagrpo").is_dir(), f"{dockerfile}: the WORKDIR holds no source tree?"
            res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_build_flags(), "-w",
                                  str(base / "dist"), str(workdir)], capture_output=True, text=True, cwd=base)
            assert res.returncode == 0, f"building the wheel of {dockerfile}'s tree: " + _said(res)
            venv = base / "venv"
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                          capture_output=True, text=True, check=True).stdout.strip())
            (purelib / "zz-parent-environment.pth").write_text("\n".join(_parent_pth_lines()) + "\n")
            wheel = next((base / "dist").glob("portagrpo-*.whl"))
            subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                            "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
            built[key] = (workdir, venv)
        out.append((dockerfile, image, *built[key]))
    return out


def test_the_installed_wheel_is_what_runs(images, tmp_path):
    for dockerfile, _, _, venv in images:
        res = _run([str(venv / "bin" / "python"), "-c", "import portagrpo.backends, portagrpo.kernels\n"
                    "from portagrpo.tools.hardware_check import find_device_tests\n"
                    "print(portagrpo.__file__); print(find_device_tests()[1])"], tmp_path, venv)
        assert res.returncode == 0, _said(res)
        where, why_not = res.stdout.splitlines()[-2:]
        assert Path(where).is_relative_to(venv), f"{dockerfile}: portagrpo imported from {where}, not the wheel"
        assert "an installed portagrpo carries no tests" in why_not  # said, since the wheel has no tests/


def test_each_image_launch_path_runs_from_its_workdir(images, tmp_path):
    """ENTRYPOINT + CMD, and ENTRYPOINT + a two-rank, two-step run, from the WORKDIR (the image's tree)."""
    stub = tmp_path / "vendor-env.sh"  # a vendor environment script the ENTRYPOINT sources (CANN's): absent here
    stub.write_text("# stands in for a vendor's set_env.sh\n")
    ran = set()
    for dockerfile, image, workdir, venv in images:
        entrypoint = [re.sub(r"(?<=source )(/\S+)", lambda m: m[1] if Path(m[1]).exists() else str(stub), part)
                      for part in image["entrypoint"]]
        assert entrypoint and "portagrpo" in " ".join(entrypoint), f"{dockerfile}: ENTRYPOINT does not start portagrpo"
        if (key := json.dumps([entrypoint, str(workdir)])) in ran:
            continue  # the same command from the same tree as an earlier image
        ran.add(key)
        res = _run(entrypoint + image["cmd"], workdir, venv, timeout=300)
        assert res.returncode == 0, f"{dockerfile}: {image['cmd']}: " + _said(res)
        run_dir = tmp_path / f"run-{dockerfile.parent.name}"
        res = _run(entrypoint + ["train", "--output-dir", str(run_dir), "trainer.nproc_per_node=2", *QUICK],
                   workdir, venv)
        assert res.returncode == 0, f"{dockerfile}: two ranks from {image['workdir']}: " + _said(res)
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]


def test_hardware_check_from_the_workdir_with_a_relative_out(images):
    _, _, workdir, venv = images[0]
    res = _run(["bash", "ci/hardware-check.sh", "--help"], workdir, venv)  # the script, as the workflow runs it
    assert res.returncode == 0 and "--size" in res.stdout, _said(res)
    site_before = {p.name for p in (venv / "lib").glob("python*/site-packages/*")}
    # the emulated device where its plugin imports (a GPU machine's bare check: the wheel, --no-deps, offline)
    probe = "from portagrpo.backends import get_backend; get_backend('emu')"  # the plugin, and a torch it runs on
    emu = _run([str(venv / "bin" / "python"), "-c", probe], workdir, venv).returncode == 0
    device = "emu" if emu else "cpu"
    env = {"PORTAGRPO_EMU_DEVICES": "1"} if emu else {}
    res = subprocess.run(["portagrpo", "hardware-check", device, "hc-report", "--size", "tiny"], cwd=workdir,
                         env={**_env(venv), **env}, capture_output=True, text=True, timeout=1200)
    out = workdir / "hc-report"
    assert (out / "report.json").is_file(), _said(res)
    report = json.loads((out / "report.json").read_text())
    failed = [(s["step"], s["tail"]) for s in report["steps"] if s["status"] == "failed"]
    assert not failed and res.returncode == 0, failed
    steps = {s["step"]: s for s in report["steps"]}
    runs = {s["step"].split(", ")[1] for s in report["steps"] if "-step run" in s["step"] and s["status"] == "passed"}
    if emu:  # one emulated device: the runs on two are said skipped, the one-rank FSDP2 offload runs
        tests = steps["device tests"]
        assert tests["status"] == "skipped" and "no test is marked emu" in tests["reason"]
        assert "this machine has one device" in steps["2-step run, ddp x2, hf"]["reason"]
        assert runs == {"one process", "embedded default", "FSDP2 with actor.offload on one rank"}
        assert steps["peak memory against portagrpo plan"]["status"] == "passed"
        assert steps["replay on device"]["status"] == "passed" and steps["parity"]["status"] == "passed"
    else:
        assert steps["device tests"]["status"] == "passed"  # ./tests/parity of the WORKDIR, run on the wheel
        assert runs == {"one process", "ddp x2", "fsdp2 x2", "embedded default", "FSDP2 with actor.offload on one rank"}
    assert steps["bench step"]["status"] == "passed" and (out / "bench-step.json").is_file()
    assert (out / "parity.json").is_file() and (out / "model" / "config.json").is_file()
    assert {p.name for p in (venv / "lib").glob("python*/site-packages/*")} == site_before  # nothing written there

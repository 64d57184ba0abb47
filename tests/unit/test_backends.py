"""Backend selection with injected probes (no device is pretended), error sentences, NPU attention."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.backends import BackendUnavailable, get_backend, npu_env
from portagrpo.backends.cpu import CPUBackend
from portagrpo.backends.cuda import CUDABackend
from portagrpo.backends.npu import NPU_ATTENTION, NPUBackend, npu_attention_forward, register_npu_attention
from portagrpo.backends.probe import RuntimeProbe
from portagrpo.backends.rocm import ROCmBackend

ROOT = Path(__file__).resolve().parents[2]


class FakeDevices:
    """Stands in for torch.cuda / torch.npu: answers the calls a backend makes."""

    def __init__(self, count=2, name="Fake GPU", bf16=True):
        self.count, self.name, self.bf16 = count, name, bf16
        self.seeds = []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def get_device_name(self, i):
        return f"{self.name} #{i}"

    def is_bf16_supported(self):
        return self.bf16

    def manual_seed_all(self, seed):
        self.seeds.append(seed)


def probe(*, cuda=None, hip=None, modules=(), devices=None):
    dev = devices if devices is not None else FakeDevices()
    return RuntimeProbe(torch_version="9.9.9", hip_version=hip, cuda_version=cuda,
                        has_module=lambda m: m in modules, device_module=lambda t: dev)


def table(p, npu_installed=False, cann=False):
    return {
        "cpu": CPUBackend,
        "cuda": lambda: CUDABackend(p),
        "rocm": lambda: ROCmBackend(p),
        "npu": lambda: NPUBackend(p, torch_npu_present=lambda: npu_installed, cann_present=lambda: cann),
    }


def test_cuda_torch_with_devices():
    p = probe(cuda="12.8")
    b = get_backend("cuda", table(p))
    assert b.name == "cuda" and b.dist_backend == "nccl" and b.device(1) == torch.device("cuda", 1)
    row = b.describe()
    assert row["device_names"] == ["Fake GPU #0", "Fake GPU #1"] and row["bf16"] is True
    assert get_backend("auto", table(p)).name == "cuda"


def test_cuda_request_on_rocm_torch_says_which_torch():
    p = probe(cuda=None, hip="6.4.1")
    with pytest.raises(BackendUnavailable, match=r"is a ROCm build \(torch.version.hip=6.4.1\); use --device rocm"):
        get_backend("cuda", table(p))
    rocm = get_backend("auto", table(p))
    assert rocm.name == "rocm" and rocm.device_type == "cuda"
    assert rocm.spec.visible_devices_env == ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def test_rocm_request_on_cuda_torch_says_which_torch():
    with pytest.raises(BackendUnavailable, match="is a CUDA 12.8 build, not a ROCm build.*or use --device cuda"):
        get_backend("rocm", table(probe(cuda="12.8")))


def test_cpu_only_torch():
    with pytest.raises(BackendUnavailable, match="CPU-only build"):
        get_backend("cuda", table(probe()))
    assert get_backend("auto", table(probe())).name == "cpu"


def test_cuda_torch_without_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BackendUnavailable, match="no device is usable.*CUDA_VISIBLE_DEVICES=''"):
        get_backend("cuda", table(probe(cuda="12.8", devices=FakeDevices(count=0))))


def test_npu_missing_runtime_sentences():
    with pytest.raises(BackendUnavailable, match="torch_npu is not installed; install the CANN toolkit"):
        get_backend("npu", table(probe()))
    with pytest.raises(BackendUnavailable, match="CANN toolkit is not loaded \\(libhccl.so was not found\\)"):
        get_backend("npu", table(probe(), npu_installed=True, cann=False))


def test_npu_preferred_by_auto_when_usable():
    p = probe(cuda="12.8", devices=FakeDevices(name="Ascend910B"))
    b = get_backend("auto", table(p, npu_installed=True, cann=True))
    assert b.name == "npu" and b.dist_backend == "hccl" and b.spec.ray_resource == "NPU"
    assert b.deterministic_env() == {"HCCL_DETERMINISTIC": "true"}


def test_env_variable_sets_default(monkeypatch):
    monkeypatch.setenv("PORTAGRPO_DEVICE", "rocm")
    with pytest.raises(BackendUnavailable, match="--device rocm cannot be used"):
        get_backend(None, table(probe(cuda="12.8")))


def test_attention_choice_cuda():
    with_fa = CUDABackend(probe(cuda="12.8", modules=("flash_attn",)))
    without = CUDABackend(probe(cuda="12.8"))
    assert with_fa.attention_implementation("auto", torch.bfloat16) == "flash_attention_2"
    assert with_fa.attention_implementation("auto", torch.float32) == "sdpa"
    assert without.attention_implementation("auto", torch.bfloat16) == "sdpa"
    with pytest.raises(BackendUnavailable, match="needs the flash_attn package"):
        without.attention_implementation("flash_attention_2", torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="needs model.dtype=bf16"):
        with_fa.attention_implementation("flash_attention_2", torch.float32)
    with pytest.raises(BackendUnavailable, match="npu_fusion"):
        without.attention_implementation("npu_fusion", torch.bfloat16)


def test_kernel_choice_follows_triton_presence():
    assert CUDABackend(probe(cuda="12.8", modules=("triton",))).kernel_implementation("auto") == "triton"
    assert CUDABackend(probe(cuda="12.8")).kernel_implementation("auto") == "chunked"
    with pytest.raises(BackendUnavailable, match="needs the triton package"):
        ROCmBackend(probe(hip="6.4")).kernel_implementation("triton")


def test_cpu_cannot_force_flash_attention():
    with pytest.raises(BackendUnavailable, match="flash_attention_2.*not available on --device cpu"):
        CPUBackend().attention_implementation("flash_attention_2", torch.bfloat16)


def test_guard_disables_autoload_when_cann_missing(monkeypatch):
    monkeypatch.delenv(npu_env.AUTOLOAD_VAR, raising=False)
    monkeypatch.setattr(npu_env, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(npu_env, "cann_found", lambda: False)
    reason = npu_env.guard_torch_import()
    assert os.environ[npu_env.AUTOLOAD_VAR] == "0" and "libhccl.so" in reason
    monkeypatch.setattr(npu_env, "cann_found", lambda: True)
    monkeypatch.delenv(npu_env.AUTOLOAD_VAR)
    assert npu_env.guard_torch_import() is None and npu_env.AUTOLOAD_VAR not in os.environ


def test_cann_search_uses_library_path(tmp_path, monkeypatch):
    (tmp_path / "libhccl.so").write_bytes(b"")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nowhere:{tmp_path}")
    assert npu_env.cann_found()


def _simulated_fused_attention():
    """npu_fusion_attention as the simulated Ascend models it from Ascend's docs (plugins/npu_sim;
    plain torch, so it also runs on CPU tensors), loaded without installing the simulated device."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "plugins" / "npu_sim" / "torch_npu" / "attention.py"
    spec = importlib.util.spec_from_file_location("npu_sim_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.npu_fusion_attention


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "no-padding"])
def test_npu_attention_adapter_matches_sdpa_in_a_real_model(padded):
    """The adapter's layout, mask inversion, causal sparse mode and GQA, end to end through a Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.model.loading import position_ids_from_mask

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).eval()
    ids = torch.randint(4, 40, (3, 9))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0  # left padding
        mask[2, :1] = 0
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        register_npu_attention(fused_op=_simulated_fused_attention())
        model.config._attn_implementation = NPU_ATTENTION
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    assert torch.allclose(out[valid], ref[valid], atol=1e-5)


def test_npu_adapter_hands_the_fused_op_kv_heads_and_causality_as_they_are():
    """GQA: the op takes Nq/Nkv itself, so K/V go in with their own heads (no repeated copy); plain
    causal attention is sparse_mode 3 with the 2048x2048 compressed mask, not a dense [Sq, Skv] one."""
    fused, seen = _simulated_fused_attention(), {}

    def recording(query, key, value, head_num, layout, **kwargs):
        seen.update(key_heads=key.shape[1], mask_shape=tuple(kwargs["atten_mask"].shape),
                    sparse_mode=kwargs.get("sparse_mode", 0))
        return fused(query, key, value, head_num, layout, **kwargs)

    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    module = torch.nn.Module().eval()
    out, _ = npu_attention_forward(module, q, k, v, None, fused_op=recording)
    assert seen == {"key_heads": 2, "mask_shape": (2048, 2048), "sparse_mode": 3}
    causal = torch.ones(5, 7, dtype=torch.bool).tril(7 - 5)  # a query shorter than its keys: bottom-right
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=causal)
    assert out.shape == (1, 5, 4, 8) and torch.allclose(out, ref.transpose(1, 2), atol=1e-5)


VENDOR_PACKAGES = ("torch_npu", "triton", "flash_attn", "vllm")


def _imported_vendors(code: str) -> list[str]:
    code += f"\nimport sys; print([m for m in {VENDOR_PACKAGES!r} if m in sys.modules])\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stderr
    return eval(res.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list


def test_importing_portagrpo_imports_no_vendor_package():
    # what torch and transformers import by themselves is theirs (torch 2.7's dynamo imports triton)
    theirs = _imported_vendors("import torch, torch._dynamo, transformers, torch.distributed.fsdp")
    ours = _imported_vendors("import portagrpo, portagrpo.cli, portagrpo.train, portagrpo.backends, portagrpo.kernels\n"
                             "from portagrpo.backends import all_backends\n"
                             "[b.is_available() for b in all_backends()]")
    assert [m for m in ours if m not in theirs] == []


def test_no_device_specific_calls_outside_backends():
    pattern = re.compile(r"torch\.cuda\.|torch\.npu|torch_npu|is_npu_available|torch\.version\.hip")
    offenders = []
    for folder in ("portagrpo", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_doctor_json():
    """In a process of its own, as users run it: probing the emulated backend installs its device process-wide
    (torch's PrivateUse1), and FSDP2's default mesh in a later test of the same process would pick it."""
    import json

    def doctor(*flags):
        res = subprocess.run([sys.executable, "-m", "portagrpo", "doctor", *flags], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout

    info = json.loads(doctor("--json"))
    rows = {r["backend"]: r for r in info["backends"]}
    assert rows["cpu"]["available"] and rows["cpu"]["dist_backend"] == "gloo"
    assert {"cpu", "cuda", "rocm", "npu"} <= set(rows)
    from importlib.metadata import entry_points

    plugins = {ep.name for ep in entry_points(group="portagrpo.backends")}
    assert set(rows) == {"cpu", "cuda", "rocm", "npu"} | plugins  # entry-point backends are listed too
    assert info["packages"]["torch"] == __import__("importlib.metadata").metadata.version("torch")
    assert "collective" in doctor()


def test_cli_module_does_not_import_torch():
    """The CANN guard in main() must run before torch is imported."""
    code = "import sys, portagrpo.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


def test_fsdp2_needs_sum_reduction(monkeypatch):
    """FSDP2 without a way to sum gradients would average them: refused when asked, DDP under auto."""
    from portagrpo.backends import base
    from portagrpo.backends.cpu import CPUBackend

    backend = CPUBackend()
    assert backend.parallel_strategy("fsdp2") == "fsdp2"
    monkeypatch.setattr(base, "fsdp2_sum_reduction_available", lambda: "trainer.parallel=fsdp2 needs torch >= 2.6")
    with pytest.raises(BackendUnavailable, match="needs torch >= 2.6"):
        backend.parallel_strategy("fsdp2")
    backend.spec = __import__("dataclasses").replace(backend.spec, default_parallel="fsdp2")
    assert backend.parallel_strategy("auto") == "ddp"


def test_npu_attention_needs_masking_utils(monkeypatch):
    from portagrpo.backends import npu

    monkeypatch.setattr(npu, "transformers_has_attention_masks", lambda: False)
    backend = npu.NPUBackend()
    assert backend.attention_implementation("auto", torch.bfloat16) == "sdpa"
    with pytest.raises(BackendUnavailable, match="transformers >= 4.53"):
        backend.attention_implementation(NPU_ATTENTION, torch.bfloat16)


def test_every_backend_implements_the_backend_protocol_the_trainer_calls():
    """The Protocol is the real contract: every registered backend (plugins included) has each of its
    members with the same parameters, and the trainer core calls nothing outside it."""
    import inspect
    import re
    from pathlib import Path

    from portagrpo.backends import Backend, all_backends

    members = {n for n in dir(Backend) if not n.startswith("_")} | {"spec"}
    for backend in all_backends():
        assert isinstance(backend, Backend), backend.name
        for name in members - {"spec", "name", "device_type", "dist_backend", "group_backend"}:
            want = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
            got = list(inspect.signature(getattr(backend, name)).parameters)
            assert got == want, (backend.name, name, got, want)
    root = Path(__file__).resolve().parents[2]
    called = set()
    for f in list((root / "portagrpo").rglob("*.py")) + [root / "backends" / "dist.py"]:
        called |= set(re.findall(r"\bbackend\.([a-z_]+)", f.read_text()))
    assert called <= members, sorted(called - members)


def test_a_rank_uses_its_own_device_or_the_one_it_sees():
    """Every device visible: local rank k drives device k. One device visible (a per-rank binding):
    every rank drives it. Otherwise a rank without a device is one sentence naming the setting."""
    assert CUDABackend(probe(cuda="12.4", devices=FakeDevices(count=4))).device(3) == torch.device("cuda", 3)
    assert CUDABackend(probe(cuda="12.4", devices=FakeDevices(count=1))).device(1) == torch.device("cuda", 0)
    with pytest.raises(BackendUnavailable, match="local rank 2 has no cuda device: this process sees 2.*"
                                                 "CUDA_VISIBLE_DEVICES"):
        CUDABackend(probe(cuda="12.4", devices=FakeDevices(count=2))).device(2)


@pytest.mark.parametrize("backend_cls", [CUDABackend, NPUBackend])
def test_a_sampler_process_gets_a_device_after_the_training_ranks(monkeypatch, backend_cls):
    """rollout.mode=one_step_off on an accelerator node: local rank r trains on device r and its sampler
    process samples on device ranks-per-node + r; fewer devices, or rollout.devices other than one per
    rank, is one sentence."""
    backend = backend_cls()
    monkeypatch.setattr(backend_cls, "device_count", lambda self: 8)
    kind = backend.device_type
    assert [backend.sampler_process_device(r, 4, 4) for r in range(4)] == [f"{kind}:{i}" for i in (4, 5, 6, 7)]
    with pytest.raises(Exception, match=r"set rollout.devices=4 \(one per rank on the node; it is 0\)"):
        backend.sampler_process_device(0, 4, 0)
    monkeypatch.setattr(backend_cls, "device_count", lambda self: 6)
    with pytest.raises(Exception, match=r"needs 8 .* devices per node \(4 training, 4 sampling\); this process sees 6"):
        backend.sampler_process_device(0, 4, 4)
    assert CPUBackend().sampler_process_device(1, 2, 0) == "cpu"  # the CPU: the cores the trainer leaves

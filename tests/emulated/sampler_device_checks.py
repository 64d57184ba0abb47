"""Checks of where a one_step_off sampler process's device is, each in a fresh process (the emulated device is
process-global, and a device runtime reads its visible-devices variable once, when it starts).

Run as `python sampler_device_checks.py NAME` with PORTAGRPO_EMU_DEVICES set; exits 0 when the check holds. Used by
test_sampler_device.py."""
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

TOK = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)


def visible_devices_are_read_once():
    """PORTAGRPO_EMU_DEVICES=3 and PORTAGRPO_EMU_VISIBLE_DEVICES=2,0: the process's emu:0 and emu:1 are the machine's
    devices 2 and 0; once the device is in use, a change of the variable changes nothing, as with CUDA."""
    from portagrpo.backends import get_backend

    backend = get_backend("emu")  # the device's first use
    assert backend.device_count() == 2
    assert [torch.emu.get_device_name(i) for i in range(2)] == [
        "emulated accelerator 2 (CPU arithmetic)", "emulated accelerator 0 (CPU arithmetic)"]
    os.environ["PORTAGRPO_EMU_VISIBLE_DEVICES"] = "1"
    assert backend.device_count() == 2 and torch.emu.device_count() == 2
    assert torch.emu.get_device_name(0) == "emulated accelerator 2 (CPU arithmetic)"
    os.environ["PORTAGRPO_EMU_VISIBLE_DEVICES"] = "2,0"  # a child of this process, narrowed to its emu:1
    assert backend.only_device_env(1) == {"PORTAGRPO_EMU_VISIBLE_DEVICES": "0"}  # the machine's device 0


def vllm_sampler_lands_on_its_own_device():
    """PORTAGRPO_EMU_DEVICES=3, every device visible: the process of a sampler placed on emu:2 (a trainer on emu:0
    or emu:1 beside it) builds its vLLM engine on the machine's device 2. vLLM's single-process executor takes device
    0 of what the process sees; before issue 45 the process started the device runtime before narrowing what it
    sees, and its engine took the machine's device 0, the first training rank's."""
    import portagrpo.model.loading as loading
    from portagrpo.rollout import process

    fake_vllm.install()  # the stand-in as vllm
    loading.load_model = lambda path, attn: torch.nn.Linear(2, 2)  # the run's initial model, as the engine's first push
    spec = process.SamplerSpec("init", "sdpa", TOK, "fp32", False, 1, device="emu:2", backend="emu", engine="vllm",
                               vllm=dict(model_path="init", dtype="float32", sleep_mode=False, eos_ids=[2]))
    engine, where = process._build_sampler(spec)
    (llm,) = fake_vllm.FakeLLM.instances
    assert llm.device_name == "emulated accelerator 2 (CPU arithmetic)", llm.device_name
    assert torch.emu.device_count() == 1 and os.environ["PORTAGRPO_EMU_VISIBLE_DEVICES"] == "2"
    assert where == "emu:2" and not engine.needs_weights


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")

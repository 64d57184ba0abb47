"""The environment a sampler process is started under so that it sees only its own device (issue 45 item 2):
`AcceleratorBackend.only_device_env`, read on each vendor's row without touching a device runtime."""
import pytest

from portagrpo.backends.base import BackendUnavailable
from portagrpo.backends.cuda import CUDABackend
from portagrpo.backends.npu import NPUBackend
from portagrpo.backends.rocm import ROCmBackend

VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)


def test_the_device_is_named_within_the_list_the_process_was_given(monkeypatch):
    assert CUDABackend().only_device_env(3) == {"CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert CUDABackend().only_device_env(2) == {"CUDA_VISIBLE_DEVICES": "6"}
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1,3")
    assert NPUBackend().only_device_env(1) == {"ASCEND_RT_VISIBLE_DEVICES": "3"}
    with pytest.raises(BackendUnavailable, match="device 2 is not among this process's visible devices"):
        NPUBackend().only_device_env(2)


def test_rocm_writes_hip_and_cuda_alike_as_vllm_requires(monkeypatch):
    """HIP reads CUDA_VISIBLE_DEVICES too, and vLLM 0.33's ROCm platform raises when it differs from
    HIP_VISIBLE_DEVICES: an inherited CUDA_VISIBLE_DEVICES is the list to narrow, and both are written."""
    assert ROCmBackend().only_device_env(1) == {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert ROCmBackend().only_device_env(1) == {"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "6,7")
    assert ROCmBackend().only_device_env(0) == {"HIP_VISIBLE_DEVICES": "6", "CUDA_VISIBLE_DEVICES": "6"}

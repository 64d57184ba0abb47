"""Issue 45: `npu_flash_varlen` reads a vision forward's window boundaries to the host once per boundary tensor, not
once per block (a vision tower hands the same `cu_seqlens` to every block), with the simulated Ascend's
npu_fusion_attention (plugins/npu_sim, loaded alone) standing in for the op."""
import importlib.util
from pathlib import Path

import torch

from portagrpo.backends.npu_varlen import npu_varlen_attention_forward

ATTENTION = Path(__file__).resolve().parents[2] / "plugins" / "npu_sim" / "torch_npu" / "attention.py"
_SPEC = importlib.util.spec_from_file_location("npu_sim_attention_reads", ATTENTION)
sim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sim)


def _forward(blocks: int, windows: torch.Tensor, full: torch.Tensor, fused) -> list[torch.Tensor]:
    """A tower's forward: even blocks attend within windows, odd ones over whole images (Qwen2.5-VL's two kinds)."""
    module, outs = torch.nn.Module().eval(), []
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    for block in range(blocks):
        cu = windows if block % 2 == 0 else full
        outs.append(npu_varlen_attention_forward(module, q, k, v, scaling=0.3, fused_op=fused, is_causal=False,
                                                 cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0])
    return outs


def test_a_forward_reads_each_boundary_tensor_once(monkeypatch):
    reads, tolist = [], torch.Tensor.tolist

    def counting(self):
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    windows, full = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    outs = _forward(8, windows, full, sim.npu_fusion_attention)
    assert len(reads) == 2, reads  # before issue 45: 16 (every block read its q and its k boundaries)
    again = _forward(8, windows.clone(), full.clone(), sim.npu_fusion_attention)  # the next forward's own tensors
    assert len(reads) == 4 and len(again) == len(outs)
    windows[1] = 2  # changed in place: read again, never served stale
    seen = []

    def recording(query, key, value, head_num, layout, **kwargs):
        seen.append(kwargs["actual_seq_qlen"])
        return sim.npu_fusion_attention(query, key, value, head_num, layout, **kwargs)

    _forward(1, windows, full, recording)
    assert seen == [[2, 8, 12, 16]] and len(reads) == 5

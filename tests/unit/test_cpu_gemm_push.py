"""The weight push on vLLM's CPU build (rollout/vllm_cpu_push.py: CpuGemmWeights) without vLLM: a model whose
`load_weights` writes as vLLM's loaders do (a fused q/k/v weight filled through `param.data.narrow(...).copy_`,
others through `param.data.copy_`), or in ways a direct copy must not imitate (a sharded source, a weight changed
after its copy). The first push records where each tensor went; later pushes copy straight there only where that
reproduces the loader exactly, and go through the loader otherwise. Real vLLM's loaders are checked in
tests/real_vllm/test_cpu_push.py."""
import pytest
import torch

from portagrpo.rollout.vllm_cpu_push import CpuGemmWeights


class Layer(torch.nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, 3), requires_grad=False)


class Loader(torch.nn.Module):
    """q, k and v into one fused weight (rows 0:4, 4:6, 6:8), o into its own; `mode` picks how."""

    def __init__(self, mode: str = "vllm") -> None:
        super().__init__()
        self.qkv, self.o = Layer(8), Layer(3)
        self.mode, self.calls = mode, 0

    def load_weights(self, weights) -> None:
        self.calls += 1
        rows = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}
        for name, w in weights:
            if name in rows:
                start, size = rows[name]
                self.qkv.weight.data.narrow(0, start, size).copy_(w)
            elif self.mode == "sharded":  # a tensor-parallel rank keeps its shard of the source
                self.o.weight.data.copy_(w.narrow(0, 0, 3))
            else:
                self.o.weight.data.copy_(w)
                if self.mode == "changed":
                    self.o.weight.data.mul_(2)


def weights(seed: int, o_rows: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("q", torch.randn(4, 3, generator=g)), ("k", torch.randn(2, 3, generator=g)),
            ("v", torch.randn(2, 3, generator=g)), ("o", torch.randn(o_rows, 3, generator=g))]


def gemms(model):
    """The fused layer's GEMM prepared (what it was prepared from recorded), the other on its weight."""
    prepared = []
    push = CpuGemmWeights(model, [model.qkv],
                          lambda layer, remove_weight: prepared.append((layer.weight.clone(), remove_weight)),
                          [model.o])
    return push, prepared


def test_later_pushes_copy_where_the_first_push_recorded_and_prepare_every_gemm_again():
    model = Loader()
    push, prepared = gemms(model)
    assert push.load(weights(0)) == 4 and model.calls == 1 and push.plan is not None
    for seed in (1, 2):
        w = dict(weights(seed))
        assert push.load(list(w.items())) == 4
        assert model.calls == 1  # the loader ran only for the first push
        fused = torch.cat([w["q"], w["k"], w["v"]])
        assert torch.equal(model.qkv.weight, fused) and torch.equal(model.o.weight, w["o"])
        # prepared once per push, from the whole new fused weight (after q, k and v were all written), kept
        assert torch.equal(prepared[-1][0], fused) and prepared[-1][1] is False
    assert len(prepared) == 3


def test_a_loader_that_shards_its_source_keeps_loading_every_push():
    model = Loader("sharded")
    push, _ = gemms(model)
    push.load(weights(0, o_rows=6))
    assert push.plan is None
    w = dict(weights(1, o_rows=6))
    push.load(list(w.items()))
    assert model.calls == 2 and torch.equal(model.o.weight, w["o"][:3])


def test_a_loader_that_changes_a_weight_after_copying_it_keeps_loading_every_push():
    model = Loader("changed")
    push, _ = gemms(model)
    push.load(weights(0))
    assert push.plan is None
    w = dict(weights(1))
    push.load(list(w.items()))
    assert model.calls == 2 and torch.equal(model.o.weight, 2 * w["o"])


def test_a_push_that_leaves_out_or_adds_a_tensor_is_refused():
    push, _ = gemms(Loader())
    push.load(weights(0))
    with pytest.raises(RuntimeError, match="did not send o"):
        push.load(weights(1)[:3])
    with pytest.raises(RuntimeError, match="sent extra, which the first push"):
        push.load(weights(1) + [("extra", torch.zeros(1))])

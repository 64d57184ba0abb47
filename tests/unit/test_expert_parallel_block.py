"""model/expert_parallel.py in one process: the expert-parallel experts module (over an ep mesh of one rank) computes
what transformers' own does, in fp64 eagerly and in fp32 through grouped_mm, names and shapes kept; the clip over
meshes is torch's clip; what cannot run is one sentence."""
import sys

import pytest
import torch

from portagrpo.config import load_config, strategy_problems
from portagrpo.model.expert_parallel import clip_over_meshes, ep_import_problem, ep_model_problem
from portagrpo.model.moe import expert_modules

needs_torchtitan = pytest.mark.skipif(ep_import_problem() is not None, reason=str(ep_import_problem()))


def tiny_moe(dtype=torch.float64, experts: int = 4, implementation: str = "eager"):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "gate_up_proj", "down_proj")):
                p.normal_(0, 0.3)
    model.config._experts_implementation = implementation
    return model


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


@needs_torchtitan
@pytest.mark.parametrize("dtype,implementation,tol", [(torch.float64, "eager", 1e-13),
                                                      (torch.float32, "grouped_mm", 2e-6)])
def test_the_expert_parallel_block_computes_what_transformers_does(one_rank, dtype, implementation, tol):
    from portagrpo.model.expert_parallel import to_expert_parallel

    ref, ep = tiny_moe(dtype, implementation=implementation), tiny_moe(dtype, implementation=implementation)
    names = [n for n, _ in ref.named_parameters()]
    to_expert_parallel(ep, one_rank)
    assert [n for n, _ in ep.named_parameters()] == names
    assert all(type(m).__name__.startswith("ExpertParallel") for m in expert_modules(ep))
    x = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    out_ref, out_ep = ref(input_ids=x).logits, ep(input_ids=x).logits
    assert float((out_ep - out_ref).detach().abs().max()) <= tol * float(out_ref.detach().abs().max())
    out_ref.square().sum().backward()
    out_ep.square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = grads[name].grad
        assert float((got - want).norm() / want.norm().clamp(min=1e-30)) < tol * 10, name


def test_what_cannot_be_split_is_one_sentence():
    dense = pytest.importorskip("transformers").LlamaForCausalLM(
        pytest.importorskip("transformers").LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    assert "has none; use trainer.parallel=fsdp2" in ep_model_problem(dense, 2)
    moe = tiny_moe(experts=4)
    assert ep_model_problem(moe, 2) is None and ep_model_problem(moe, 4) is None
    problem = ep_model_problem(moe, 3)
    assert "trainer.ep_size=3 must divide the model's 4 experts" in problem and problem.count(". ") == 0


def test_without_torchtitan_the_sentence_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.models.common.token_dispatcher", None)
    problem = ep_import_problem()
    assert problem.startswith("trainer.parallel=ep runs torchtitan's all-to-all token dispatcher")
    assert "portagrpo[ep]" in problem and "trainer.parallel=fsdp2" in problem


@pytest.mark.skipif(ep_import_problem() is not None, reason=str(ep_import_problem()))
def test_a_torch_without_the_call_the_dispatcher_makes_is_one_sentence(monkeypatch):
    """torchtitan 0.3.0's token exchanges call torch.compiler._is_non_strict_tracing (token_dispatcher.py:259, 326,
    354), which the torch 2.10 and 2.11 wheels lack: there the import succeeds and the first forward would raise
    AttributeError, so the refusal comes first."""
    monkeypatch.delattr(torch.compiler, "_is_non_strict_tracing")
    problem = ep_import_problem()
    assert "torch.compiler._is_non_strict_tracing" in problem and "torch 2.12" in problem, problem


def test_ep_size_is_applied_or_refused():
    def problems(world, strategy, *pairs):
        return strategy_problems(load_config(None, list(pairs)), world, strategy)

    assert problems(4, "ep", "trainer.parallel=ep", "trainer.ep_size=2") == []
    assert problems(4, "ep", "trainer.parallel=ep") == []
    assert "must divide the 4 ranks" in problems(4, "ep", "trainer.parallel=ep", "trainer.ep_size=3")[0]
    assert "set trainer.parallel=ep" in problems(4, "fsdp2", "trainer.ep_size=2")[0]
    assert "is not a group size" in problems(4, "ep", "trainer.parallel=ep", "trainer.ep_size=0")[0]


def test_the_clip_over_meshes_is_torchs_clip_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(a, 0.5)
    got = clip_over_meshes(b, 0.5)
    assert float(got) == pytest.approx(float(want), rel=1e-14)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad, rtol=1e-14, atol=0)

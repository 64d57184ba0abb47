"""Run by portagrpo.launcher on two emu ranks: a tiny Llama whose `lm_head` is tied to its embedding, sharded
with FSDP2, pushed weight by weight as the vLLM weight push does (`strategy.full_tensors`). Prints
JSON: the names pushed, the all-gathers counted during the push, and the parameters' count."""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from portagrpo.backends import get_backend
from portagrpo.backends.dist import init_collectives
from portagrpo.kernels import logprob_impl
from portagrpo.model.parallel import make_strategy
from portagrpo.model.scorer import ResponseScorer

backend = get_backend("emu").require()
comm = init_collectives(backend, timeout_s=300)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True)
lm = LlamaForCausalLM(config).to(backend.device(comm.env.local_rank))
assert lm.lm_head.weight is lm.model.embed_tokens.weight
strategy = make_strategy("fsdp2", comm)
scorer = strategy.wrap(ResponseScorer(lm, logprob_impl("reference")), trainable=True, compute_dtype=torch.float32)

from portagrpo_emu.counters import COUNTERS  # noqa: E402

COUNTERS.mark("push")
names = [name for name, _ in strategy.full_tensors(scorer)]
counts = COUNTERS.spans[-1]["collectives"]
if comm.rank == 0:
    print(json.dumps({"names": names, "all_gathers": counts.get("all_gather", 0),
                      "parameters": len(list(scorer.parameters()))}))
comm.close()
sys.exit(0)

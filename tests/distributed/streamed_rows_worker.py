"""One rank of the streamed-rows check (run by portagrpo.launcher): a tiny Llama with an untied head and embedding of
101 rows (uneven over 2, 3 and 4 ranks) under FSDP2, scored and differentiated twice from the same weights, once
with both read one rank's rows at a time (model/parallel.py StreamedRows) and once through their gathered units.
Writes each rank's log-probs, entropies, whole gradients and how often a gathered unit ran to OUT/rank<R>.pt.
Usage: streamed_head_worker.py OUT DTYPE (fp32 | bf16)
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from portagrpo.backends.dist import Collectives
from portagrpo.kernels import logprob_impl
from portagrpo.model.parallel import FSDP2
from portagrpo.model.scorer import ResponseScorer
from portagrpo.model.weight_push import gathered

VOCAB = 101


def score(streamed: bool, dtype: torch.dtype | None, rank: int) -> dict:
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                                      max_position_embeddings=64))
    # actor.stream_head_rows (default true) or false: the gathered units
    scorer = FSDP2(Collectives(), stream_rows=streamed).wrap(ResponseScorer(lm, logprob_impl("chunked")),
                                                             trainable=True, compute_dtype=dtype)
    assert (scorer.streamed_head is not None and scorer.streamed_embedding is not None) == streamed
    calls, lookups = [], []
    through = scorer.through_head
    scorer.through_head = lambda fn, *args: calls.append(1) or through(fn, *args)
    lm.model.embed_tokens.register_forward_pre_hook(lambda *_: lookups.append(1))
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, with a ragged response mask
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    rmask = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [4]])
    logp, ent, _, _ = scorer(ids, mask, ids[:, 7:], rmask, 0.8, True, False)
    w1, w2 = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    ((logp * w1 * rmask).sum() + (ent * w2 * rmask).sum()).backward()
    grads = {name: gathered(p.grad).detach().clone() for name, p in scorer.named_parameters() if p.grad is not None}
    with torch.no_grad():  # a reference's pass: no gradient, the same numbers
        ref, _, _, _ = scorer(ids, mask, ids[:, 7:], rmask, 0.8, False, False)
    return {"logp": logp.detach()[rmask], "entropy": ent.detach()[rmask], "grads": grads, "gathered_calls": len(calls),
            "gathered_lookups": len(lookups),
            "no_grad_logp": ref[rmask]}


def main() -> None:
    out, dtype = Path(sys.argv[1]), {"fp32": None, "bf16": torch.bfloat16}[sys.argv[2]]
    torch.set_num_threads(1)
    from portagrpo.backends import get_backend
    from portagrpo.backends.dist import init_collectives

    init_collectives(get_backend("cpu"), 300)  # over the store the launcher bound
    rank = dist.get_rank()
    result = {"streamed": score(True, dtype, rank), "gathered": score(False, dtype, rank)}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

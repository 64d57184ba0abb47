"""One rank of the Ulysses check (run by portagrpo.launcher): a tiny Llama scores one micro-batch of packed rows on
every rank alone (sequence-parallel size 1, the reference) and then split over groups of SP ranks; the loss (a
token-mean policy-gradient term plus an entropy bonus) is computed from the gathered per-token values, and the sum of
each group's parameter gradients must equal the reference's.
Usage: ulysses_worker.py OUT DEVICE DTYPE SP KV_HEADS [offload]. Writes errors_rank<r>.json: relative errors.
KV_HEADS `vl`: the tiny Qwen2.5-VL policy on rows with images (the vision tower runs on every rank before the split).
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from portagrpo.backends import get_backend
from portagrpo.backends.dist import init_collectives
from portagrpo.kernels import logprob_impl
from portagrpo.model.activation_offload import HostActivations
from portagrpo.model.scorer import ResponseScorer
from portagrpo.model.ulysses import sequence_groups
from portagrpo.tolerances import relative_error

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
# prompt and response lengths of the micro-batch's rows: sequences cross shard borders, one is cut mid-response
LENGTHS = [(5, 9), (3, 2), (7, 13), (2, 1)]


def batch(device, vocab: int):
    """tests/unit/test_packed_rows.py's left-padded rows of LENGTHS, and an advantage per row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_packed_rows import long_rows

    rows, _ = long_rows(device, vocab, LENGTHS)
    return rows + [torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(1)).to(device)]


def vl_batch(device):
    """The tiny Qwen2.5-VL policy and rows of three prompts (two images of different sizes, one without) with
    responses; returns (model, data, lengths, images)."""
    import io

    from PIL import Image

    from portagrpo.config import load_config
    from portagrpo.data.records import PromptRecord
    from portagrpo.model import vision

    def png(size, rgb):
        out = io.BytesIO()
        Image.new("RGB", size, rgb).save(out, format="PNG")
        return out.getvalue()

    processor = vision.build_tiny_processor()
    tiny = load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny
    records = [PromptRecord(0, [{"role": "user", "content": "<image>colour?"}], "r", "x",
                            images=(png((56, 56), (250, 0, 0)),)),
               PromptRecord(1, [{"role": "user", "content": "no picture here"}], "n", "x"),
               PromptRecord(2, [{"role": "user", "content": "the colour of <image>?"}], "b", "x",
                            images=(png((84, 56), (0, 0, 250)),))]
    ids, images = vision.vision_prompts(processor, records, device)
    responses = [7, 12, 4]
    p_max, t_max = max(len(x) for x in ids), max(responses)
    g = torch.Generator().manual_seed(0)
    full = torch.full((3, p_max + t_max), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(full)
    for i, (x, r) in enumerate(zip(ids, responses)):
        full[i, p_max - len(x):p_max] = torch.tensor(x)
        full[i, p_max:p_max + r] = torch.randint(5, 100, (r,), generator=g)
        mask[i, p_max - len(x):p_max + r] = 1
    data = [t.to(device) for t in (full, mask, full[:, p_max:], mask[:, p_max:].bool(), torch.randn(3, generator=g))]
    model = vision.build_tiny_vl_model(tiny, processor.tokenizer, seed=1)
    return model, data, [(len(x), r) for x, r in zip(ids, responses)], images


def loss_and_grads(scorer, params, data, lengths=LENGTHS, images=None):
    ids, mask, resp, rmask, adv = data
    counts = (int(mask.sum()), int(rmask.sum()))
    extra = {} if images is None else {"images": images}
    logp, ent, _, _ = scorer(ids, mask, resp, rmask, 0.7, True, False, counts=counts, lengths=lengths, **extra)
    n = rmask.sum()
    loss = -(logp * adv[:, None] * rmask).sum() / n - 0.01 * (ent * rmask).sum() / n
    for p in params:
        p.grad = None
    loss.backward()
    return logp.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]


def scoring_error(split, whole, data, lengths, images, group) -> float:
    """A scoring pass under sequence parallelism: each rank of the group brings other rows (every sp-th from its
    rank), the group scores their union, and each rank's log-probs and entropies equal one rank scoring them alone."""
    from portagrpo.batch import RolloutBatch
    from portagrpo.model.scorer import response_stats

    ids, mask, resp, rmask, _ = data
    p = ids.shape[1] - resp.shape[1]
    n = ids.shape[0]
    every = RolloutBatch(ids[:, :p], mask[:, :p], resp, rmask.float(), torch.arange(n), torch.arange(n), [], [], [], [],
                         lengths=list(lengths), images=images)
    mine = every.select(list(range(group.rank, n, group.size)))
    with torch.no_grad():
        got = response_stats(split, mine, temperature=0.7, compute_entropy=True)
        want = response_stats(whole, mine, temperature=0.7, compute_entropy=True)
    return max(relative_error(got.logp.cpu(), want.logp.cpu()), relative_error(got.entropy.cpu(), want.entropy.cpu()))


def main() -> None:
    out, device, dtype, sp, kv = Path(sys.argv[1]), sys.argv[2], DTYPES[sys.argv[3]], int(sys.argv[4]), sys.argv[5]
    offload = "offload" in sys.argv[6:]
    from transformers import LlamaConfig, LlamaForCausalLM

    backend = get_backend(device)
    comm = init_collectives(backend, 120.0)
    dev = backend.device(comm.env.local_rank)
    torch.manual_seed(0)
    if kv == "vl":
        lm, data, lengths, images = vl_batch(dev)
        lm = lm.to(dtype=dtype).to(dev)
    else:
        config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=int(kv), attn_implementation="sdpa")
        lm = LlamaForCausalLM(config).to(dtype=dtype).to(dev)
        data, lengths, images = batch(dev, config.vocab_size), LENGTHS, None
    params = [p for p in lm.parameters() if p.requires_grad]
    ref_logp, ref = loss_and_grads(ResponseScorer(lm, logprob_impl("reference")), params, data, lengths, images)
    group = sequence_groups(comm.world_size, comm.rank, sp)
    acts = HostActivations(backend.spec.pinned_offload) if offload else None
    if offload:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        lm.train()
    split = ResponseScorer(lm, logprob_impl("reference"), acts, sequence_parallel=group)
    logp, grads = loss_and_grads(split, params, data, lengths, images)
    errors = {"logp": relative_error(logp.cpu(), ref_logp.cpu()),
              "scoring": scoring_error(split, ResponseScorer(lm, logprob_impl("reference")), data, lengths, images,
                                       group)}
    names = [n for n, p in lm.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, grads, ref):
        # the group's partial gradients add up to the micro-batch's: gathered as int64 bits (no collective library is
        # asked for float64) and summed on the host
        bits = g.contiguous().view(torch.int64) if dtype == torch.float64 else g.contiguous()
        parts = [torch.empty_like(bits) for _ in range(sp)]
        dist.all_gather(parts, bits, group=group.group)
        total = sum(p.cpu().view(dtype) if dtype == torch.float64 else p.cpu() for p in parts)
        errors[name] = relative_error(total, r.cpu())
    if offload:
        errors["moved_bytes"] = acts.moved_bytes
    (out / f"errors_rank{comm.rank}.json").write_text(json.dumps(errors))
    comm.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

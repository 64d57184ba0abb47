"""Model forward to per-token statistics of the response: log-probs, entropy, vocab log-probs.

`ResponseScorer` wraps a causal LM so that the whole computation — the transformer body up
to the final hidden states, then the chosen kernel over the LM head — runs inside one module
forward. Sharding wrappers (FSDP2) then see the LM-head weight gathered exactly while it is
used, and fused kernels never need full-vocabulary logits.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.errors import UserError
from portagrpo.kernels import TokenLogprobFn, logits_from_hidden, token_logprobs_from_logits
from portagrpo.kernels.streamed import embedding_streamed, token_logprobs_streamed
from portagrpo.model import moe
from portagrpo.model.activation_offload import HostActivations
from portagrpo.model.loading import decoder_of, lm_head_of, position_ids_from_mask, run_in_head
from portagrpo.model.router_replay import RouterHooks, RoutesSeen, Routing, widen
from portagrpo.model.ulysses import (
    PACKED_PREFIX,
    GatherTokens,
    Packing,
    SequenceGroup,
    check_same_rows,
    plan_row,
    sequence_parallel_problem,
    use_packed_attention,
)
from portagrpo.model.vision import vl_body, vl_hidden_states, vl_inputs

if TYPE_CHECKING:
    from portagrpo.model.parallel import StreamedRows


@dataclass
class ResponseStats:
    logp: torch.Tensor  # [B, T] fp32 (fp64 for fp64 models), 0 off the mask
    entropy: torch.Tensor | None  # [B, T]
    logp_vocab: torch.Tensor | None  # [B, T, V] full log-distribution (only for the `full` KL)
    # a MoE policy's forward (model/router_replay.py): the routes its routers chose on the batch's grid (when its
    # Routing records), and (agreeing, compared) counts of its decisions against the batch's routes
    routes: torch.Tensor | None = None
    route_counts: tuple[torch.Tensor, torch.Tensor] | None = None


def true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the `count` True entries of `mask`, in order, without asking the device how
    many there are (`nonzero` and boolean indexing wait for that answer): the k-th True entry is the
    first place where the running count of Trues reaches k."""
    running = mask.flatten().long().cumsum(0)
    wanted = torch.arange(1, count + 1, device=mask.device, dtype=running.dtype)
    return torch.searchsorted(running, wanted)


def _scatter(values: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Put N per-token values back at their flat `positions` of the [B, T] grid (zeros elsewhere),
    keeping autograd. The result is a tensor of its own, not a view: FSDP2 warns of a view returned by a
    wrapped module (an in-place op on it would skip the pre-backward hook)."""
    out = values.new_zeros(tuple(shape) + tuple(values.shape[1:]))
    width = shape[1]
    return out.index_put((positions // width, positions % width), values)


def lm_head_operands(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The LM head's operands in the autocast dtype when autocast is on (as autocast would give
    any other linear layer), so a bf16 step multiplies bf16 operands into fp32 results whatever the
    dtype of the master weights; unchanged otherwise."""
    kind = h.device.type
    if not torch.is_autocast_enabled(kind):
        return h, weight, bias
    dtype = torch.get_autocast_dtype(kind)
    return h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


# Attention implementations that read packed sequences from restarting position ids: a dense
# block-causal mask (sdpa, eager) or variable-length kernels (flash_attention_2).
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2")
MAX_DENSE_PACKED_MASK = 2**24  # elements of the [N, N] mask a dense implementation builds


def packing_pays(n_valid: int, batch: int, width: int, hidden_size: int, attention: str | None) -> bool:
    """Whether one packed row of the `n_valid` real tokens costs less than the padded [batch, width]
    grid. Per layer the linear maps cost ~3 x hidden per token and attention ~1 per attended pair
    (both in units of 4 x hidden FLOPs); a dense mask attends all n_valid^2 pairs of the packed row,
    a variable-length kernel only each sequence's own."""
    if attention not in PACKABLE_ATTENTION or n_valid >= batch * width:
        return False
    if attention == "flash_attention_2":
        return True
    if n_valid * n_valid > MAX_DENSE_PACKED_MASK:
        return False
    return n_valid * (3 * hidden_size + n_valid) < batch * width * (3 * hidden_size + width)


def mask_form(config) -> str | None:
    """The 4D attention mask this model's attention implementation takes from transformers: "bool"
    (True = attend; sdpa and implementations registered with sdpa's mask) or "additive" (eager), or
    None where transformers should build its own (flash-attention, flex, unknown)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None
    fn = ALL_MASK_ATTENTION_FUNCTIONS[impl]
    return {ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]: "bool", ALL_MASK_ATTENTION_FUNCTIONS["eager"]: "additive"}.get(fn)


@functools.lru_cache(maxsize=None)
def _takes_mask_mapping(decoder_class: type) -> bool:
    """Whether this transformers decoder accepts its per-layer-type masks ready-made (a dict, as
    `generate` passes them) instead of building them, which reads the device to look for padding."""
    try:
        return "causal_mask_mapping" in inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False


def causal_without_padding(decoder, form: str, dtype: torch.dtype, like: torch.Tensor):
    """The attention mask to hand a decoder for rows without padding: none at all (plain causal, the
    fastest kernels) for a "bool" implementation when the decoder takes ready-made masks and has only
    full-attention layers; else the causal 4D mask, which a decoder would otherwise build itself after
    reading the device to look for packed sequences (eager always needs it)."""
    sliding = "sliding_attention" in (getattr(decoder.config, "layer_types", None) or ())
    if form == "bool" and not sliding and _takes_mask_mapping(type(decoder)):
        return {"full_attention": None}
    return attention_mask_4d(torch.zeros_like(like), torch.ones_like(like, dtype=torch.bool), form, dtype)


def attention_mask_4d(seq_id: torch.Tensor, valid: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, S, S] causal mask within each sequence: query i attends key j <= i of the same `seq_id`
    when j is a real token (`valid`), and always itself (a padding query then has a defined output,
    which nobody reads). Built here from what the host already knows, instead of transformers checking
    the device for padding on every forward (a host synchronisation)."""
    s = seq_id.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seq_id.device).tril()
    allowed = causal & (seq_id[:, :, None] == seq_id[:, None, :]) & valid[:, None, :]
    allowed = (allowed | torch.eye(s, dtype=torch.bool, device=seq_id.device))[:, None]
    if form == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _text_hidden(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_valid: int, packed: bool,
                 embedded: Callable[[torch.Tensor], dict[str, torch.Tensor]]):
    """The decoder's output over left-padded rows: packed into one row, or over the padded grid. `embedded` turns
    token ids into the decoder's input (`ResponseScorer.embedded`)."""
    positions = position_ids_from_mask(attention_mask)
    form, dtype = mask_form(decoder.config), decoder.get_input_embeddings().weight.dtype
    if packed:
        # One row of every sequence's tokens, positions restarting per sequence: attention stays
        # within each sequence (block-causal), and no work goes to padding.
        keep = true_positions(attention_mask.bool(), n_valid)
        ids, pos = input_ids.flatten()[keep].unsqueeze(0), positions.flatten()[keep].unsqueeze(0)
        mask = None if form is None else attention_mask_4d(
            (pos == 0).long().cumsum(1), torch.ones_like(ids, dtype=torch.bool), form, dtype)
        return decoder(**embedded(ids), attention_mask=mask, position_ids=pos, use_cache=False)
    mask = attention_mask
    if form is not None:  # whether there is padding at all is known on the host
        padded = n_valid < attention_mask.numel()
        mask = attention_mask_4d(torch.zeros_like(attention_mask), attention_mask.bool(), form, dtype) \
            if padded else causal_without_padding(decoder, form, dtype, attention_mask)
    return decoder(**embedded(input_ids), attention_mask=mask, position_ids=positions, use_cache=False)


class ResponseScorer(torch.nn.Module):
    """Causal LM + token log-prob kernel as one module. `generate` is forwarded to the LM."""

    def __init__(self, lm: torch.nn.Module, kernel: TokenLogprobFn, activations: HostActivations | None = None,
                 sequence_parallel: SequenceGroup | None = None, varlen: Callable | None = None,
                 remove_padding: bool = True, routers: RouterHooks | None = None) -> None:
        super().__init__()
        self.lm = lm
        # a MoE policy's router hooks (model/router_replay.py), installed on its routers once, here; None: none
        self.kernel = kernel
        self.activations = activations  # model.enable_activation_offload: a training forward's activations to host
        # actor.ulysses_sequence_parallel_size: the group of ranks that splits each packed row (model/ulysses.py)
        self.sequence_parallel = sequence_parallel
        self.varlen = varlen  # the backend's variable-length attention for packed rows (None: block-diagonal SDPA)
        # model.use_remove_padding: packed rows attend within each sequence through model/ulysses.py's attention
        self.remove_padding = remove_padding
        self.routers = routers
        # the LM head's computation runs through this; FSDP2 makes it the forward of the head's own unit
        # (model/parallel.py split_root), so the head is gathered for it and its gradient reduce-scattered after
        self.through_head = run_in_head
        # FSDP2 with an untied head and embedding, each a unit of its own: the head's and the embedding's rows read
        # one rank's at a time (model/parallel.py StreamedRows), so no rank gathers either whole to score or train;
        # None: whole where it computes
        self.streamed_head: StreamedRows | None = None
        self.streamed_embedding: StreamedRows | None = None
        self.packs = remove_padding and use_packed_attention(decoder_of(lm).config, flash=sequence_parallel is not None)
        if sequence_parallel is not None:
            c = decoder_of(lm).config
            problem = sequence_parallel_problem(sequence_parallel.size, c.num_attention_heads,
                                                getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                                                bool(moe.moe_layers(lm)))
            if problem:
                raise UserError(problem)
        if sequence_parallel is not None and not self.packs:
            raise UserError(f"actor.ulysses_sequence_parallel_size={sequence_parallel.size} splits packed rows, and "
                            f"this model's attention ({decoder_of(lm).config._attn_implementation!r}) or "
                            f"model.use_remove_padding={remove_padding} packs none; use model.attn_implementation=sdpa "
                            f"and model.use_remove_padding=true.")

    def embedded(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder's input for token ids: their embeddings where they are read by rows (`streamed`), else the
        ids themselves."""
        out = self.streamed(ids)
        return {"input_ids": ids} if out is None else {"inputs_embeds": out}

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids as embeddings (a vision-language row's, before its image features go in)."""
        out = self.streamed(ids)
        return self.lm.get_input_embeddings()(ids) if out is None else out

    def streamed(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The embeddings of `ids` looked up one rank's rows at a time (`streamed_embedding`), or None where the
        embedding is not read by rows. Where gradients are on, they ask for one (as transformers'
        enable_input_require_grads makes a frozen embedding's output do), so a LoRA model's layers, checkpointed
        or not, run their backward."""
        embed = self.lm.get_input_embeddings()
        blocks = None if self.streamed_embedding is None else self.streamed_embedding.blocks(embed.weight, ids.device)
        if blocks is None:
            return None
        out = embedding_streamed(ids, embed.weight.to_local(), blocks, padding_idx=embed.padding_idx,
                                 weight_dtype=self.streamed_embedding.param_dtype)
        if torch.is_grad_enabled() and not out.requires_grad:
            out.requires_grad_(True)
        return out

    def _offloaded(self) -> ContextManager:
        return contextlib.nullcontext() if self.activations is None else self.activations.around(self.lm)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, P + T]
        attention_mask: torch.Tensor,  # [B, P + T]
        responses: torch.Tensor,  # [B, T]
        response_mask: torch.Tensor,  # [B, T] bool
        temperature: float,
        compute_entropy: bool,
        vocab: bool,
        autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        counts: tuple[int, int] | None = None,  # (valid tokens, response tokens), known on the host
        images=None,  # vision-language rows: their prompts' images (model/vision.py: PromptImages)
        lengths: list[tuple[int, int]] | None = None,  # each row's (prompt, response) tokens, known on the host
        routes: torch.Tensor | None = None,  # a MoE batch's routes on this grid [B, P + T, L, k] (-1: unknown)
        routing: Routing | None = None,  # what this forward does with them (model/router_replay.py)
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, RoutesSeen | None]:
        """(log-probs, entropy, vocabulary log-probs) on the [B, T] grid, and what a MoE policy's routers did."""
        if counts is None:
            counts = (int(attention_mask.sum()), int(response_mask.sum()))  # one read; response_stats passes them
        if self.routers is None or (routing is None and routes is None):
            return (*self._forward(input_ids, attention_mask, responses, response_mask, temperature, compute_entropy,
                                   vocab, autocast, counts, images, lengths), None)
        routing = routing or Routing(None, replay=False, record=False)
        with self.routers.forward(routes, attention_mask.bool(), counts[0], apply=routing.replay,
                                  record=routing.record, count=True) as fwd:
            stats = self._forward(input_ids, attention_mask, responses, response_mask, temperature, compute_entropy,
                                  vocab, autocast, counts, images, lengths)
        return (*stats, fwd.seen())

    def _forward(self, input_ids, attention_mask, responses, response_mask, temperature, compute_entropy, vocab,
                 autocast, counts, images, lengths):
        prompt_len, t = input_ids.shape[1] - responses.shape[1], responses.shape[1]
        n_valid, n_response = counts
        if self.packs and lengths is not None and _packs_through_ulysses(
                n_valid, attention_mask.numel(), images is not None, self.sequence_parallel is not None):
            return self._packed_forward(input_ids, attention_mask, responses, response_mask, temperature,
                                        compute_entropy, vocab, autocast, counts, images, lengths)
        decoder = decoder_of(self.lm)
        # rows with images are packed only through model/ulysses.py's attention (above)
        # the base implementation decides (model/ulysses.py's packed form passes a dense mask through to it)
        attention = (getattr(decoder.config, "_attn_implementation", None) or "").removeprefix(PACKED_PREFIX)
        packed = images is None and self.remove_padding and packing_pays(n_valid, *attention_mask.shape,
                                                                         decoder.config.hidden_size, attention)
        with autocast(), self._offloaded():
            if images is not None:
                out = vl_hidden_states(self.lm, input_ids, attention_mask, images, prompt_len, self.embeddings)
            else:
                out = _text_hidden(decoder, input_ids, attention_mask, n_valid, packed, self.embedded)
        with autocast():
            hidden = _last_hidden(out)
            # The hidden state at position p predicts token p + 1; `at` lists the response tokens.
            at = true_positions(response_mask, n_response)
            if packed:
                # Row-major index of every grid position among the valid tokens (what packing kept).
                packed_index = attention_mask.bool().flatten().long().cumsum(0).sub_(1).view(attention_mask.shape)
                h = hidden[0].index_select(0, packed_index[:, prompt_len - 1:prompt_len + t - 1].flatten()[at])
            else:
                h = hidden[:, prompt_len - 1:prompt_len + t - 1].flatten(0, 1)[at]
            targets = responses.flatten()[at]
        logp, entropy, logp_vocab = self._token_stats(h, targets, temperature, compute_entropy, vocab, autocast)
        return _grid(logp, entropy, logp_vocab, at, response_mask.shape)

    def _token_stats(self, h: torch.Tensor, targets: torch.Tensor, temperature: float, compute_entropy: bool,
                     vocab: bool, autocast: Callable[[], ContextManager]):
        """Per-token log-prob, entropy and (`vocab`) full log-distribution of hidden states h [n, H] -> [n]."""
        weight = lm_head_of(self.lm)[0] if self.streamed_head is not None and not vocab else None
        blocks = None if weight is None else self.streamed_head.blocks(weight, h.device)
        if blocks is not None:
            local = weight.to_local()
            with autocast():  # the blocks' dtype: autocast's where it is on, else the strategy's parameter dtype
                h, like, _ = lm_head_operands(h, local.new_empty(0, dtype=self.streamed_head.param_dtype), None)
            logp, entropy = token_logprobs_streamed(h, local, targets, blocks, weight_dtype=like.dtype,
                                                    temperature=temperature, compute_entropy=compute_entropy)
            return logp, entropy, None
        return self.through_head(self._head_stats, h, targets, temperature, compute_entropy, vocab, autocast)

    def _head_stats(self, h: torch.Tensor, targets: torch.Tensor, temperature: float, compute_entropy: bool,
                    vocab: bool, autocast: Callable[[], ContextManager]):
        with autocast():
            weight, bias = lm_head_of(self.lm)
            h, weight, bias = lm_head_operands(h, weight, bias)
        if vocab:
            logits = logits_from_hidden(h, weight, bias, temperature)
            logp, entropy = token_logprobs_from_logits(logits, targets, compute_entropy)
            return logp, entropy, torch.log_softmax(logits, dim=-1)
        logp, entropy = self.kernel(h, weight, targets, bias=bias, temperature=temperature,
                                    compute_entropy=compute_entropy)
        return logp, entropy, None

    def _packed_forward(self, input_ids, attention_mask, responses, response_mask, temperature, compute_entropy,
                        vocab, autocast, counts, images, lengths):
        """The rows packed into one row without padding (model/ulysses.py), split over the sequence-parallel group
        when there is one: this rank runs the decoder over its part of the row, the LM head and the kernel over its
        response tokens, and the group's per-token results are gathered (with autograd) onto the [B, T] grid."""
        n_valid, n_response = counts
        sp, prompt_len = self.sequence_parallel, input_ids.shape[1] - responses.shape[1]
        if sp is not None:  # host read: one small gather of the lengths per micro-batch, against a silent mismatch
            check_same_rows(lengths, sp)
        row = plan_row(lengths, sp)
        keep = true_positions(attention_mask.bool(), n_valid)
        pad = sum(row.seqlens) - n_valid
        with autocast(), self._offloaded():
            if images is not None:  # the vision tower runs on every rank before the split (its features are few)
                embeds, positions = vl_inputs(self.lm, input_ids, attention_mask, images, prompt_len, self.embeddings)
                embeds = _pad_rows(embeds.flatten(0, 1).index_select(0, keep), pad)[row.start:row.stop]
                positions = _pad_rows(positions.flatten(-2).index_select(-1, keep).movedim(-1, 0), pad)
                inputs = {"inputs_embeds": embeds[None],
                          "position_ids": positions[row.start:row.stop].movedim(0, -1).unsqueeze(-2)}
                decoder = vl_body(self.lm).language_model
            else:
                ids = _pad_rows(input_ids.flatten().index_select(0, keep), pad)
                pos = _pad_rows(position_ids_from_mask(attention_mask).flatten().index_select(0, keep), pad)
                inputs = {**self.embedded(ids[row.start:row.stop][None]), "position_ids": pos[row.start:row.stop][None]}
                decoder = decoder_of(self.lm)
            out = decoder(**inputs, attention_mask=_no_mask(decoder), use_cache=False,
                          packing=Packing(row.seqlens, sp, self.varlen))
        a, b = row.mine
        with autocast():
            local = torch.tensor(row.predicting[a:b], dtype=torch.long).sub_(row.start).to(input_ids.device)
            h = _last_hidden(out)[0].index_select(0, local)
            at = true_positions(response_mask, n_response)
            targets = responses.flatten()[at][a:b]
        stats = self._token_stats(h, targets, temperature, compute_entropy, vocab, autocast)
        if sp is not None:
            stats = tuple(None if x is None else GatherTokens.apply(x, sp, row.counts) for x in stats)
        return _grid(*stats, at, response_mask.shape)

    def generate(self, **kwargs):
        return self.lm.generate(**kwargs)


def _packs_through_ulysses(n_valid: int, grid: int, images: bool, split: bool) -> bool:
    """Whether a micro-batch goes through model/ulysses.py's packed row: always under sequence parallelism; where
    there is padding, for vision-language rows (their 3-D positions are selected per token) and for text rows too long
    for one dense block-causal mask (short text rows keep `packing_pays`'s choice: one batched call over the grid or
    the dense mask is faster than one attention call per sequence)."""
    if split:
        return True
    return n_valid < grid and (images or n_valid * n_valid > MAX_DENSE_PACKED_MASK)


def _last_hidden(out) -> torch.Tensor:
    return out if torch.is_tensor(out) else out[0] if isinstance(out, tuple) else out.last_hidden_state


def _grid(logp, entropy, logp_vocab, at: torch.Tensor, grid: torch.Size):
    """Per-token values of the response tokens `at` back on the [B, T] grid (zeros elsewhere)."""
    return tuple(None if x is None else _scatter(x, at, grid) for x in (logp, entropy, logp_vocab))


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [N, ...] with n more rows: zeros for ids and embeddings, positions 0..n-1 for position ids (a sequence of
    its own that pads a packed row to a multiple of the sequence-parallel size)."""
    if n == 0:
        return x
    if x.dtype == torch.long:
        extra = torch.arange(n, device=x.device).view((n,) + (1,) * (x.dim() - 1)).expand((n,) + x.shape[1:])
    else:
        extra = x.new_zeros((n,) + tuple(x.shape[1:]))
    return torch.cat([x, extra.to(x.dtype)])


def _no_mask(decoder):
    """The attention mask of a packed row: none (model/ulysses.py's attention keeps to each sequence itself). A
    decoder that takes ready-made masks gets an empty mapping; another a 4-D placeholder, which transformers passes
    through unread."""
    if _takes_mask_mapping(type(decoder)):
        return {k: None for k in ("full_attention", "sliding_attention")}
    return torch.ones(1, 1, 1, 1, dtype=torch.bool)


def response_stats(
    scorer: ResponseScorer,
    batch: RolloutBatch,
    *,
    temperature: float,
    compute_entropy: bool,
    vocab: bool = False,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    shared_rows: bool = False,
    routing: Routing | None = None,
) -> ResponseStats:
    """Per-token statistics of `batch`'s responses. Every shape comes from the batch's host lengths,
    so nothing here waits for the device. Under sequence parallelism the ranks of a group score together: with
    `shared_rows` (the update) they hold the same rows; without (a scoring pass, each rank its own share) the group
    scores the union of its ranks' rows and each rank keeps its own (`group_stats`). `routing`: what a MoE policy's
    forward does with the batch's routes (model/router_replay.py); the routes it records and its agreement counts
    come back in the statistics."""
    group = getattr(getattr(scorer, "scorer", scorer), "sequence_parallel", None)  # AdaptersOff wraps the policy's
    if group is not None and not shared_rows:
        return group_stats(scorer, batch, group, temperature=temperature, compute_entropy=compute_entropy,
                           vocab=vocab, autocast=autocast)
    trimmed, t_full = trim_padding(batch)
    lengths = batch.host_lengths()
    counts = (sum(p + r for p, r in lengths), sum(r for _, r in lengths))
    extra = {} if batch.images is None else {"images": batch.images}
    problem = None if routing is None else routing.problem(batch.routes is not None)
    if problem:
        raise UserError(problem)
    p0, width = batch.prompt_len - trimmed.prompt_len, trimmed.prompt_len + trimmed.responses.shape[1]
    routes = None if batch.routes is None or routing is None else batch.routes[:, p0:p0 + width]
    logp, entropy, logp_vocab, seen = scorer(trimmed.input_ids, trimmed.attention_mask, trimmed.responses,
                                             trimmed.response_mask.bool(), temperature, compute_entropy, vocab,
                                             autocast, counts, lengths=lengths, routes=routes, routing=routing,
                                             **extra)
    grow = lambda x: None if x is None else _pad_time(x, t_full)  # noqa: E731
    if seen is None:
        return ResponseStats(grow(logp), grow(entropy), grow(logp_vocab))
    full = batch.prompt_len + batch.responses.shape[1]
    recorded = None if seen.routes is None else widen(seen.routes, p0, full - p0 - width)
    counted = None if seen.total is None else (seen.agree, seen.total)
    return ResponseStats(grow(logp), grow(entropy), grow(logp_vocab), recorded, counted)


def group_stats(scorer, batch: RolloutBatch, group: SequenceGroup, **kwargs) -> ResponseStats:
    """`response_stats` of this rank's rows when each rank of its sequence-parallel group brings its own: the ranks'
    rows (their tensors, lengths and images, through host memory) are joined into one batch, scored by the group
    together (each rank runs 1 / sp of the union's tokens, as many as its own rows hold on average), and each rank
    keeps its rows' statistics."""
    from dataclasses import replace

    lean = replace(batch, response_text=[], ground_truth=[], data_source=[], extra_info=[], rollout_logp=None,
                   model_mask=None, routes=None, lengths=batch.host_lengths()).map(lambda t: t.cpu())
    parts = [None] * group.size  # host read: the group's rows, once per scoring micro-batch
    torch.distributed.all_gather_object(parts, lean, group=group.group)
    width = max(p.responses.shape[1] for p in parts)
    parts = [replace(p, responses=_pad_time(p.responses, width), response_mask=_pad_time(p.response_mask, width))
             for p in parts]
    device = batch.responses.device
    union = RolloutBatch.cat(parts, pad_id=0).map(lambda t: t.to(device))
    stats = response_stats(scorer, union, shared_rows=True, **kwargs)
    first, t = sum(p.size for p in parts[:group.rank]), batch.responses.shape[1]
    return ResponseStats(*(None if x is None else x[first:first + batch.size, :t]
                           for x in (stats.logp, stats.entropy, stats.logp_vocab)))


def trim_padding(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The batch without the columns no row uses: prompt columns that are padding in every row (prompts
    are left-padded to the longest in the whole step) and response columns past the longest response
    of these rows (responses are right-padded to max_response_length). Causal attention makes every
    kept position's output independent of the dropped ones, so only work is saved. The widths come
    from the host lengths; returns the trimmed batch and the original response width."""
    from dataclasses import replace

    t_full = batch.responses.shape[1]
    lengths = batch.host_lengths()
    p0 = batch.prompt_len - max(max(p for p, _ in lengths), 1)
    t = max(max(r for _, r in lengths), 1)
    if p0 == 0 and t == t_full:
        return batch, t_full
    return replace(batch, prompt_ids=batch.prompt_ids[:, p0:], prompt_mask=batch.prompt_mask[:, p0:],
                   responses=batch.responses[:, :t], response_mask=batch.response_mask[:, :t]), t_full


def _pad_time(x: torch.Tensor, t_full: int) -> torch.Tensor:
    """[B, t, ...] -> [B, t_full, ...] with zeros after t (keeps autograd)."""
    missing = t_full - x.shape[1]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], missing) + tuple(x.shape[2:]))], dim=1)


class AdaptersOff:
    """The reference policy of a LoRA run: the same scorer with its adapters disabled, so the
    frozen base weights serve as the reference without a second copy in memory."""

    def __init__(self, scorer: ResponseScorer) -> None:
        self.scorer = scorer

    def __call__(self, *args, **kwargs):
        with self.scorer.lm.disable_adapter():
            return self.scorer(*args, **kwargs)


@contextlib.contextmanager
def eval_mode(scorer):
    """Score without dropout, then restore the mode the policy was in (the update trains)."""
    module = getattr(scorer, "scorer", scorer)  # AdaptersOff wraps the policy's scorer
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)

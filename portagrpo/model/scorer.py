"""Model forward to per-token statistics of the response: log-probs, entropy, vocab log-probs.

`ResponseScorer` wraps a causal LM so that the whole computation — the transformer body up
to the final hidden states, then the chosen kernel over the LM head — runs inside one module
forward. Sharding wrappers (FSDP2) then see the LM-head weight gathered exactly while it is
used, and fused kernels never need full-vocabulary logits.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.kernels import TokenLogprobFn, logits_from_hidden, token_logprobs_from_logits
from portagrpo.model.loading import decoder_of, lm_head_of, position_ids_from_mask


@dataclass
class ResponseStats:
    logp: torch.Tensor  # [B, T] fp32 (fp64 for fp64 models), 0 off the mask
    entropy: torch.Tensor | None  # [B, T]
    logp_vocab: torch.Tensor | None  # [B, T, V] full log-distribution (only for the `full` KL)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put N per-token values back on the [B, T] grid (zeros off the mask), keeping autograd."""
    out = torch.zeros(mask.shape + values.shape[1:], dtype=values.dtype, device=values.device)
    return out.index_put(mask.nonzero(as_tuple=True), values)


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


class ResponseScorer(torch.nn.Module):
    """Causal LM + token log-prob kernel as one module. `generate` is forwarded to the LM."""

    def __init__(self, lm: torch.nn.Module, kernel: TokenLogprobFn) -> None:
        super().__init__()
        self.lm = lm
        self.kernel = kernel

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
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        prompt_len, t = input_ids.shape[1] - responses.shape[1], responses.shape[1]
        decoder = decoder_of(self.lm)
        positions = position_ids_from_mask(attention_mask)
        valid = attention_mask.bool()
        # Row-major index of every grid position among the valid tokens (what packing keeps).
        packed_index = valid.flatten().long().cumsum(0).sub_(1).view(valid.shape)
        n_valid = int(packed_index[-1, -1]) + 1
        packed = packing_pays(n_valid, *valid.shape, decoder.config.hidden_size,
                              getattr(decoder.config, "_attn_implementation", None))
        with autocast():
            if packed:
                # One row of every sequence's tokens, positions restarting per sequence: transformers
                # then attends within each sequence only (block-causal), and no work goes to padding.
                out = decoder(input_ids=input_ids[valid].unsqueeze(0), position_ids=positions[valid].unsqueeze(0),
                              use_cache=False)
            else:
                out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                              use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        # The hidden state at position p predicts token p + 1.
        if packed:
            h = hidden[0, packed_index[:, prompt_len - 1:prompt_len + t - 1][response_mask]]  # [N, H]
        else:
            h = hidden[:, prompt_len - 1:prompt_len + t - 1][response_mask]
        targets = responses[response_mask]
        weight, bias = lm_head_of(self.lm)
        if vocab:
            logits = logits_from_hidden(h, weight, bias, temperature)
            logp, entropy = token_logprobs_from_logits(logits, targets, compute_entropy)
            logp_vocab = _scatter(torch.log_softmax(logits, dim=-1), response_mask)
        else:
            logp, entropy = self.kernel(h, weight, targets, bias=bias, temperature=temperature,
                                        compute_entropy=compute_entropy)
            logp_vocab = None
        return (_scatter(logp, response_mask), None if entropy is None else _scatter(entropy, response_mask),
                logp_vocab)

    def generate(self, **kwargs):
        return self.lm.generate(**kwargs)


def response_stats(
    scorer: ResponseScorer,
    batch: RolloutBatch,
    *,
    temperature: float,
    compute_entropy: bool,
    vocab: bool = False,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> ResponseStats:
    trimmed, t_full = trim_padding(batch)
    logp, entropy, logp_vocab = scorer(trimmed.input_ids, trimmed.attention_mask, trimmed.responses,
                                       trimmed.response_mask.bool(), temperature, compute_entropy, vocab, autocast)
    grow = lambda x: None if x is None else _pad_time(x, t_full)  # noqa: E731
    return ResponseStats(grow(logp), grow(entropy), grow(logp_vocab))


def trim_padding(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The batch without the columns no row uses: prompt columns that are padding in every row (prompts
    are left-padded to the longest in the whole step) and response columns past the longest response
    of these rows (responses are right-padded to max_response_length). Causal attention makes every
    kept position's output independent of the dropped ones, so only work is saved. One host read of
    two numbers; returns the trimmed batch and the original response width."""
    from dataclasses import replace

    t_full = batch.responses.shape[1]
    used_prompt = batch.prompt_mask.sum(0) > 0
    first = torch.where(used_prompt, torch.arange(used_prompt.numel(), device=used_prompt.device), used_prompt.numel())
    p0, t = (int(v) for v in torch.stack([first.min(), batch.response_mask.sum(1).max().long()]).tolist())
    p0, t = min(p0, batch.prompt_len - 1), max(t, 1)
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

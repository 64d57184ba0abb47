"""Sampling on vLLM without vLLM itself: portagrpo's sampling settings as `vllm.SamplingParams` takes them, which
log-probs vLLM reports and how they are read back, a group's copies of a prompt as one request, and the process's
random streams that vLLM draws from."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from portagrpo.rollout.settings import SamplingParams


def sampling_kwargs(
    params: SamplingParams, *, seed: int | None, stop_token_ids: list[int], n: int = 1
) -> dict[str, Any]:
    """portagrpo sampling settings as `vllm.SamplingParams` keyword arguments."""
    greedy = params.temperature <= 0
    return {
        "n": n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0 if greedy or params.top_k <= 0 else int(params.top_k),  # 0 is "off" in every version
        "min_p": 0.0 if greedy else float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "max_tokens": int(params.max_tokens),
        "seed": seed,
        "stop_token_ids": list(stop_token_ids),
        "detokenize": False,
        "logprobs": 0,  # the sampled token's own log-prob (0 alternatives); its distribution: LOGPROBS_MODE
    }


# vLLM's sampler reports log-probs "raw" (the model's full softmax, its default) or "processed" (after
# penalties, temperature, min-p and top-k/top-p: the distribution it draws from). The sampler's log-prob
# is the processed one, so the importance ratio against the trainer accounts for truncation (TRL asks
# the same of vLLM). The engine argument exists in every supported version (vllm/config/model.py).
LOGPROBS_MODE = "processed_logprobs"


def raw_is_processed(params: SamplingParams) -> bool:
    """Whether vLLM's raw log-probs (the model's softmax, before penalties and temperature) equal the processed
    ones for these settings: no repetition penalty, and greedy or temperature 1 without truncation."""
    if params.repetition_penalty != 1.0:
        return False
    plain = params.temperature == 1.0 and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
    return params.temperature <= 0 or plain


def sampled_logprobs(output, count: int) -> list[float]:
    """The sampled tokens' log-probs of one vLLM completion (`CompletionOutput.logprobs`: per token, a
    dict from token id to Logprob that always holds the sampled token)."""
    steps = output.logprobs or []
    return [float(step[token].logprob) for token, step in zip(list(output.token_ids)[:count], steps)]


def seed_streams(seed: int) -> None:
    """Python's, NumPy's and torch's global generators (torch's on every device), as vLLM's `set_random_seed`
    seeds them; the run's backend seeds them its way (`Backend.seed`), this is for an engine built bare."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def request_groups(requests: list[list[int]], greedy: bool) -> list[tuple[list[int], int]]:
    """Consecutive copies of one prompt (a group's n samples) as one request for that many samples. vLLM refuses
    n > 1 for greedy sampling, whose copies would be identical anyway: one request each there."""
    out: list[tuple[list[int], int]] = []
    for ids in requests:
        if out and not greedy and out[-1][0] == ids:
            out[-1] = (ids, out[-1][1] + 1)
        else:
            out.append((ids, 1))
    return out

"""vLLM's routes on the trainer's grid: the experts `CompletionOutput.routed_experts` reports per token (vLLM's
`enable_return_routed_experts`) as a route grid (model/router_replay.py), and a build's refusal to report them."""
from __future__ import annotations

import torch

from portagrpo.errors import UserError
from portagrpo.model.moe import ROUTE_DTYPE


def routes_from_engine(per_sample: list, prompt_lengths: list[int], prompt_mask: torch.Tensor, max_tokens: int,
                       layers: list[int], top_k: int) -> torch.Tensor:
    """A route grid [B, P + max_tokens, L, k] from an engine's routes per sample, each [prompt + output - 1, all
    decoder layers, k] (vLLM's `CompletionOutput.routed_experts`: every token that went through the model, so all
    but the last one sampled). The prompt's rows go to the columns of its real tokens (where `prompt_mask` is 1; left
    -1 when the engine saw another prompt length, as an expanded image prompt), output token j's to column P + j; the
    last sampled token's column, and every column past the end, stay -1, as the hf engine leaves them."""
    rows, width = prompt_mask.shape
    out = torch.full((rows, width + max_tokens, len(layers), top_k), -1, dtype=ROUTE_DTYPE)
    index = torch.tensor(layers, dtype=torch.long)
    for b, (routed, plen) in enumerate(zip(per_sample, prompt_lengths)):
        if routed is None:
            continue
        grid = torch.as_tensor(routed).to(torch.long).index_select(1, index).to(ROUTE_DTYPE)  # [N, L, k]
        real = prompt_mask[b].nonzero().flatten().cpu()
        if real.numel() == plen:
            out[b, real] = grid[:plen]
        fed = min(grid.shape[0] - plen, max_tokens)
        if fed > 0:
            out[b, width:width + fed] = grid[plen:plen + fed]
    return out.to(prompt_mask.device)


def vllm_routes_refused(err: BaseException) -> UserError:
    """vLLM's refusal to return routed experts (its CPU build: the capture needs its GPU model runner) as one
    sentence."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    first = lines[0]
    for line in lines:  # a pydantic ValidationError (vLLM's config) names the reason on a line of its own
        if "Value error, " in line:
            first = line.split("Value error, ", 1)[1].split(" [type=", 1)[0]
            break
    return UserError(f"actor.router_replay=R3 needs vLLM to return the experts it routed each token to "
                     f"(enable_return_routed_experts), and this vLLM build refused ({first}); use rollout.engine=hf, "
                     f"or actor.router_replay=R2.")

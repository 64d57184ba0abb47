"""Router replay as data: what a scorer forward does with a MoE policy's routers is a value handed to it.

A *route* grid is `[B, S, L, k]` int16: for row b, column s (the grid of a RolloutBatch's `input_ids`: left-padded
prompt, then right-padded response), MoE layer l, the k experts the token there was sent to; -1 where no route is
known (the router then chooses live). Router replay (`actor.router_replay`, verl's names):
- R3: the rollout engine's routes (the hf engine records them in its own `generate`) are replayed by the scoring and
  the update forwards;
- R2: the scoring pass (the old policy) records its routes and the update replays them.
A replayed token keeps the experts it is given and weighs them with the live router's probabilities (softmax over
all experts, gathered at the given ones, renormalised where the model renormalises), so the router's gradient flows
exactly as it does through a live top-k.

How it flows. The run decides a `Routing` (mode, replay or not, record or not) for each forward; the scorer's forward
takes it with the batch's routes (`response_stats`) and returns what its routers did (`RoutesSeen`: the routes
recorded, and how many decisions agreed with the batch's) in `ResponseStats`, which reach the metrics with every
other statistic. `RouterHooks` are installed once, when the scorer is built, on each MoE block's router; they read
only the forward that is running (`RouterHooks.forward`), and a gradient-checkpointed layer's recomputation reads the
forward it recomputes (`checkpoint_context`). Nothing is stored on the Hugging Face model.

Two router layouts are read: transformers >= 5 (`gate` a top-k router module returning (logits, weights, indices))
and transformers 4.x (`gate` an `nn.Linear` giving logits, the top-k inside the block).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from portagrpo.errors import UserError
from portagrpo.model.moe import ROUTE_DTYPE, MoeLayer, base_lm, moe_layers


def live_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] router logits -> [N, k] the experts a live router takes (softmax in fp32, then top-k, as transformers)."""
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1).indices


def replayed_weights(logits: torch.Tensor, experts: torch.Tensor, renormalise: bool, scoring: str = "softmax",
                     scale: float = 1.0) -> torch.Tensor:
    """[N, E] logits, [N, k] given experts -> [N, k] their weights from the live router (differentiable in the
    logits, as a live top-k is). `softmax` (Qwen): the softmax over every expert gathered at the given ones, divided
    by their sum when the model renormalises its top-k. `sigmoid` (DeepSeek-V3's router, transformers'
    DeepseekV3TopkRouter): each given expert's sigmoid, divided by their sum (+1e-20) when renormalised, times
    `scale` (routed_scaling_factor); its choosing bias never weighs."""
    if scoring == "sigmoid":
        weights = logits.float().sigmoid().gather(1, experts)
        if renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * scale).to(logits.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., k] x [..., k] -> [...] bool: the same set of experts (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


@dataclass(frozen=True)
class Routing:
    """What one forward of the policy does with its routers, beside the batch's routes (`RolloutBatch.routes`, the
    sampler's, or under R2 after a scoring pass the old policy's): `replay` them (else the routers choose live and
    are only compared with them), `record` the routes the routers choose."""

    mode: str | None  # actor.router_replay: None, R2 or R3
    replay: bool
    record: bool

    @classmethod
    def scoring(cls, mode: str | None) -> "Routing":
        """A scoring pass (the old policy, no gradient): R3 replays the sampler's routes, R2 records its own."""
        return cls(mode, replay=mode == "R3", record=mode == "R2")

    @classmethod
    def update(cls, mode: str | None, old_routes: bool) -> "Routing":
        """An update's forward: R3 replays the sampler's routes; R2 replays the old policy's where this step's scoring
        pass recorded them (`old_routes`; an on-policy step has none: its update, the old policy itself, routes
        live)."""
        return cls(mode, replay=mode == "R3" or (mode == "R2" and old_routes), record=False)

    def problem(self, has_routes: bool) -> str | None:
        """Why this forward cannot run on a batch with (or without) routes, in one sentence; None when it can."""
        if self.mode == "R3" and not has_routes:
            return ("actor.router_replay=R3 replays the sampler's experts, and this step's batch came without them "
                    "(a multi-turn conversation's batch carries no routes yet); set actor.router_replay=null.")
        return None


@dataclass(frozen=True)
class RoutesSeen:
    """What one forward's routers did: the routes they chose on the forward's grid (when it recorded), and of the
    (token, layer) decisions compared with the batch's routes, how many chose the same experts (device tensors;
    None where nothing was compared)."""

    routes: torch.Tensor | None = None
    agree: torch.Tensor | None = None
    total: torch.Tensor | None = None


def add_counts(a: tuple[torch.Tensor, torch.Tensor] | None,
               b: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two forwards' (agreeing, compared) route decisions, summed; None where neither compared any."""
    if b is None:
        return a
    return b if a is None else (a[0] + b[0], a[1] + b[1])


def route_metrics(counts: tuple[torch.Tensor, torch.Tensor] | None, comm) -> dict[str, float] | None:
    """`moe/route_agreement`: the share of the (token, layer) top-k decisions of the step's policy forwards that chose
    the same experts as the batch's routes (the sampler's; R2: the old policy's), summed over ranks; None when nothing
    was compared. # host read: one per step, with routes"""
    if counts is None:
        return None
    both = torch.stack([counts[0].double().cpu(), counts[1].double().cpu()])
    if comm is not None and comm.world_size > 1:
        both = comm.sum_on_host(both)
    agree, total = both.tolist()
    return {"moe/route_agreement": agree / total} if total else None


def _real_positions(valid: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the `count` real tokens of `valid`, in order, without asking the device how many there are
    (a packed forward's token order: the k-th real token is where the running count first reaches k)."""
    running = valid.flatten().long().cumsum(0)
    return torch.searchsorted(running, torch.arange(1, count + 1, device=valid.device, dtype=running.dtype))


@dataclass
class Forward:
    """One forward's routing: its grid [B, S] (`valid`: the real tokens), the routes it is given on that grid (or
    None), what it does with them, and what the hooks saw (recorded routes by layer, agreement counts). Made by
    `RouterHooks.forward` and dropped after it."""

    given: torch.Tensor | None  # [B, S, L, k]
    valid: torch.Tensor  # [B, S] bool
    n_valid: int
    apply: bool = True  # replay `given` (else compare it with the live routes)
    record: bool = False
    count: bool = False  # count where the live routers agreed with `given`
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k]
    agree: torch.Tensor | None = None
    total: torch.Tensor | None = None

    def flat(self, grid: torch.Tensor, n: int) -> torch.Tensor:
        """The grid's rows for a forward over `n` tokens: the whole [B*S] grid, or its real tokens packed."""
        whole = grid.flatten(0, 1)
        if n == whole.shape[0]:
            return whole
        if n == self.n_valid:
            return whole.index_select(0, _real_positions(self.valid, n))
        raise RuntimeError(f"a MoE forward over {n} tokens matches neither the route grid ({whole.shape[0]}) nor its "
                           f"{self.n_valid} real tokens")

    def seen(self) -> RoutesSeen:
        return RoutesSeen(grid_of(self, tuple(self.valid.shape)) if self.record and self.recorded else None,
                          self.agree, self.total)


class RouterHooks:
    """Forward hooks on every MoE router of one model, installed once when its scorer is built; they act only inside
    `forward` (and the recomputation of a checkpointed layer of that forward), and apply the backend's vendor top-k
    (`select`: `Backend.moe_topk`) to every forward where there is one."""

    def __init__(self, layers: list[MoeLayer], select: Callable | None = None) -> None:
        self.layers, self.select = layers, select
        self.active: Forward | None = None  # the forward running now
        self.recomputing = False  # a checkpointed layer recomputed in the backward: replay as it did, count nothing
        self.handles = [layer.gate.register_forward_hook(self._hook(layer)) for layer in layers]

    @classmethod
    def install(cls, model, select: Callable | None = None) -> "RouterHooks | None":
        """The hooks of `model`'s routers; None for a dense model."""
        layers = moe_layers(base_lm(model))
        return cls(layers, select) if layers else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @contextlib.contextmanager
    def forward(self, given: torch.Tensor | None, valid: torch.Tensor, n_valid: int, *, apply: bool = True,
                record: bool = False, count: bool = False) -> Iterator[Forward]:
        """Around one forward over the grid `valid` ([B, S] bool, the real tokens): replay `given` ([B, S, L, k], -1 =
        live) where `apply`, else compare it with the live routes where `count`; record the live routes where
        `record`. Yields the forward's record (`Forward.seen` after it)."""
        fwd = Forward(given, valid, n_valid, apply=apply, record=record, count=count and given is not None)
        previous, self.active = self.active, fwd
        try:
            yield fwd
        finally:
            self.active = previous

    def checkpoint_context(self):
        """torch.utils.checkpoint's `context_fn` (non-reentrant): a checkpointed layer's recomputation in the backward
        routes as its forward did, under the forward that was running when it was checkpointed."""
        return contextlib.nullcontext(), self._recomputing(self.active)

    @contextlib.contextmanager
    def _recomputing(self, fwd: Forward | None) -> Iterator[None]:
        previous, self.active, self.recomputing = self.active, fwd, True
        try:
            yield
        finally:
            self.active, self.recomputing = previous, False

    def _hook(self, layer: MoeLayer):
        def hook(module, args, output):
            fwd = self.active
            # the backend's top-k op is a softmax top-k (Backend.moe_topk): it serves softmax routers only
            vendor = self.select is not None and layer.layout == "router" and layer.scoring == "softmax"
            if fwd is None and not vendor:
                return None
            logits = output[0] if layer.layout == "router" else output
            live = output[2] if layer.layout == "router" else live_topk(logits, layer.top_k)
            if vendor:  # the backend's op picks the experts; their weights come from the live softmax
                live = self.select(logits, layer.top_k)
                output = (logits, replayed_weights(logits, live, layer.norm_topk_prob), live)
            if fwd is not None and fwd.record and not self.recomputing:
                fwd.recorded[layer.index] = live.detach().to(ROUTE_DTYPE)
            if fwd is None or fwd.given is None or not (fwd.apply or fwd.count):
                return output if vendor else None
            given = fwd.flat(fwd.given[:, :, layer.index], logits.shape[0]).long()
            known = given[:, 0] >= 0
            chosen = torch.where(known[:, None], given, live)
            if fwd.count and not self.recomputing:
                rows = known & fwd.flat(fwd.valid[..., None], logits.shape[0])[:, 0]
                agree, total = (same_experts(live, chosen) & rows).sum(), rows.sum()
                fwd.agree = agree if fwd.agree is None else fwd.agree + agree
                fwd.total = total if fwd.total is None else fwd.total + total
            if not fwd.apply:
                return output if vendor else None
            if layer.layout == "router":
                weights = replayed_weights(logits, chosen, layer.norm_topk_prob, layer.scoring, layer.scale)
                return logits, weights, chosen
            # transformers 4.x: the block takes top-k of softmax(logits) itself; logits masked to the chosen experts
            # give it exactly those, weighted by the renormalised live probabilities
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, chosen, True) | ~known[:, None]
            return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
        return hook


def grid_of(fwd: Forward, shape: tuple[int, int]) -> torch.Tensor:
    """The recorded routes of one forward over the [B, S] grid (packed forwards: -1 at padding) as [B, S, L, k]."""
    layers = [fwd.recorded[i] for i in sorted(fwd.recorded)]
    stacked = torch.stack(layers, dim=1)  # [N, L, k]
    b, s = shape
    if stacked.shape[0] == b * s:
        return stacked.view(b, s, *stacked.shape[1:])
    out = stacked.new_full((b * s, *stacked.shape[1:]), -1)
    out[_real_positions(fwd.valid, stacked.shape[0])] = stacked
    return out.view(b, s, *stacked.shape[1:])


def widen(routes: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """A route grid with `left` unknown (-1) columns before and `right` after: a trimmed forward's routes back on
    the batch's grid."""
    if left == 0 and right == 0:
        return routes
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=-1)


def in_row_order(parts: list[torch.Tensor], order: list[int], device) -> torch.Tensor:
    """Routes recorded micro-batch by micro-batch (`parts`, of rows `order`) as one grid in row order."""
    routes = torch.cat(parts)
    if order == sorted(order):
        return routes
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return routes.index_select(0, torch.tensor(back, dtype=torch.long).to(device, non_blocking=True))


class GenerationRoutes:
    """Records the routes of every forward of a transformers `generate` and assembles them on the rollout's grid:
    the prompt's columns from the prefill (a prefill shared by a group's repeats is taken per distinct prompt),
    then one column per generated token fed back in. The last generated token is never fed in: its column, and
    every column past the end of generation, stays -1 (no later token depends on its route)."""

    def __init__(self, hooks: RouterHooks | None, model) -> None:
        from portagrpo.model.loading import decoder_of

        self.hooks = hooks
        self.decoder = decoder_of(base_lm(model))
        self.calls: list[tuple[int, int, Forward]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator["GenerationRoutes"]:
        if self.hooks is None:
            yield self
            return
        handle = self.decoder.register_forward_pre_hook(self._start, with_kwargs=True)
        previous = self.hooks.active
        try:
            yield self
        finally:
            handle.remove()
            self.hooks.active = previous

    def _start(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        b, s = x.shape[0], x.shape[1]
        fwd = Forward(None, torch.ones(b, s, dtype=torch.bool), b * s, record=True)
        self.calls.append((b, s, fwd))
        self.hooks.active = fwd

    def grid(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, width: int) -> torch.Tensor | None:
        """[B, width, L, k] on the rollout's grid (prompt columns, then response columns); None for a dense model."""
        if self.hooks is None or not self.calls:
            return None
        rows = prompt_ids.shape[0]
        layers = len(self.hooks.layers)
        k = self.hooks.layers[0].top_k
        out = torch.full((rows, width, layers, k), -1, dtype=ROUTE_DTYPE, device=prompt_ids.device)
        column = 0
        for b, s, fwd in self.calls:
            if column >= width:
                break
            r = grid_of(fwd, (b, s)).to(prompt_ids.device)
            if b != rows:  # a prefill over the distinct prompts (engines.py: _shared_prefill), copied to repeats
                both = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
                r = r.index_select(0, torch.unique(both, dim=0, return_inverse=True)[1])
            s = min(s, width - column)
            out[:, column:column + s] = r[:, :s]
            column += s
        return out


ENGINES_WITH_ROUTES = ("hf", "vllm")  # the hf engine records its routes; vLLM returns them (rollout/vllm_routes.py)


def refuse_r3_engine(mode: str | None, engine: str) -> None:
    """R3 replays the experts the sampler chose, so the engine must say which: the hf engine records them, vLLM
    returns them with `enable_return_routed_experts` (a build that cannot, its CPU build, refuses when the engine is
    built: `vllm_routes_refused`); the others do not."""
    if mode == "R3" and engine not in ENGINES_WITH_ROUTES:
        raise UserError(f"actor.router_replay=R3 replays the experts the sampler chose, and rollout.engine={engine} "
                        f"does not say which it chose; use rollout.engine=hf or vllm, or actor.router_replay=R2.")

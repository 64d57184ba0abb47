"""Mixture-of-experts routing: each token's top-k experts per MoE layer, recorded in a forward and replayed in another.

A *route* grid is `[B, S, L, k]` int16: for row b, column s (the grid of a RolloutBatch's `input_ids`: left-padded
prompt, then right-padded response), MoE layer l, the k experts the token there was sent to; -1 where no route is
known (the router then chooses live). Router replay (`actor.router_replay`, verl's names):
- R3: the rollout engine's routes (the hf engine records them in its own `generate`) are replayed by the scoring and
  the update forwards;
- R2: the scoring pass (the old policy) records its routes and the update replays them.
A replayed token keeps the experts it is given and weighs them with the live router's probabilities (softmax over
all experts, gathered at the given ones, renormalised where the model renormalises), so the router's gradient flows
exactly as it does through a live top-k.

Hooks sit on each MoE block's router and change its output only; they work the same under DDP, FSDP2 (the
hooks see the gathered weights' outputs) and gradient checkpointing (a recomputed forward replays the same routes).
Two router layouts are read: transformers >= 5 (`gate` a top-k router module returning (logits, weights, indices))
and transformers 4.x (`gate` an `nn.Linear` giving logits, the top-k inside the block).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from portagrpo.errors import UserError

ROUTE_DTYPE = torch.int16  # expert ids up to 32767 (Qwen3: 128, DeepSeek-V3: 256); -1: not known
REPLAY_MODES = (None, "R2", "R3")


@dataclass(frozen=True)
class MoeLayer:
    """One MoE block: its router module, its layout, its top-k and expert count."""

    index: int  # among the model's MoE layers (the L axis of a route grid)
    gate: torch.nn.Module
    layout: str  # "router" (transformers >= 5: the gate returns (logits, weights, indices)), "linear" (4.x)
    top_k: int
    num_experts: int
    norm_topk_prob: bool


def base_lm(model) -> torch.nn.Module:
    """The transformers model under our wrappers (the scorer's `.lm`, peft)."""
    lm = getattr(model, "lm", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def _decoder_layers(model) -> list[torch.nn.Module]:
    from portagrpo.model.loading import decoder_of

    return list(getattr(decoder_of(base_lm(model)), "layers", []))


def moe_layers(model) -> list[MoeLayer]:
    """The model's MoE blocks in layer order (a decoder layer whose `mlp` has a `gate` and `experts`); [] for a dense
    model."""
    out = []
    for layer in _decoder_layers(model):
        block = getattr(layer, "mlp", None)
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        if gate is None or experts is None:
            continue
        if hasattr(gate, "top_k"):  # transformers >= 5: a router module
            out.append(MoeLayer(len(out), gate, "router", gate.top_k, gate.num_experts, bool(gate.norm_topk_prob)))
        elif isinstance(gate, torch.nn.Linear) and hasattr(block, "top_k"):  # transformers 4.x
            out.append(MoeLayer(len(out), gate, "linear", block.top_k, block.num_experts,
                                bool(getattr(block, "norm_topk_prob", False))))
    return out


def is_moe(model) -> bool:
    return bool(moe_layers(model))


@dataclass(frozen=True)
class MoeShape:
    """What a plan needs to count a MoE model: experts, the parameters a token uses and the route buffers."""

    moe_layers: int
    num_experts: int
    top_k: int
    total_params: int
    active_params: int  # parameters one token's forward touches: all but the experts it is not routed to
    route_bytes_per_token: int  # a route grid's int16 entries per token (L x k x 2 bytes)


def moe_shape(model) -> MoeShape | None:
    """Total and active parameter counts and the routing buffer per token; None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    total = sum(p.numel() for p in model.parameters())
    expert_params = 0
    for layer in _decoder_layers(model):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            expert_params += sum(p.numel() for p in experts.parameters())
    e, k = layers[0].num_experts, layers[0].top_k
    active = total - expert_params + expert_params * k // e
    return MoeShape(len(layers), e, k, total, active, len(layers) * k * 2)


def live_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] router logits -> [N, k] the experts a live router takes (softmax in fp32, then top-k, as transformers)."""
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1).indices


def replayed_weights(logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """[N, E] logits, [N, k] given experts -> [N, k] their weights from the live router: the softmax over every
    expert gathered at the given ones, divided by their sum when the model renormalises its top-k (differentiable
    in the logits, as a live top-k is)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., k] x [..., k] -> [...] bool: the same set of experts (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


@dataclass
class RouteTally:
    """(token, layer) decisions where a live router agreed with the batch's routes, and how many were compared, per
    kind of forward: the scoring pass (no gradient: the weights the batch was sampled with) and the update's (which
    may come after an optimizer step). Device tensors, read once per step."""

    agree: dict[bool, torch.Tensor] = field(default_factory=dict)  # by torch.is_grad_enabled()
    total: dict[bool, torch.Tensor] = field(default_factory=dict)
    # R2: this step's scoring pass recorded the old policy's routes into the batch (an on-policy step has no scoring
    # pass, and its update, the old policy itself, routes live)
    old_routes: bool = False

    def add(self, agree: torch.Tensor, total: torch.Tensor) -> None:
        kind = torch.is_grad_enabled()
        self.agree[kind] = self.agree.get(kind, 0) + agree
        self.total[kind] = self.total.get(kind, 0) + total

    def take(self, comm=None) -> float | None:
        """The share of agreeing decisions since the last take, summed over ranks: the scoring passes' where any ran,
        else the update's (a fully on-policy step has no scoring pass); None if nothing was compared."""
        self.old_routes = False
        kind = False if False in self.total else True
        if kind not in self.total:
            return None
        both = torch.stack([self.agree[kind].double().cpu(), self.total[kind].double().cpu()])
        self.agree, self.total = {}, {}
        if comm is not None and comm.world_size > 1:
            both = comm.sum_on_host(both)
        agree, total = both.tolist()
        return agree / total if total else None


def _real_positions(valid: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the `count` real tokens of `valid`, in order, without asking the device how many there are
    (a packed forward's token order: the k-th real token is where the running count first reaches k)."""
    running = valid.flatten().long().cumsum(0)
    return torch.searchsorted(running, torch.arange(1, count + 1, device=valid.device, dtype=running.dtype))


@dataclass
class _Plan:
    """How one forward's flat token axis maps to a route grid: the grid [B, S, L, k] (replayed, or None), which
    positions are real tokens, and what the hooks recorded."""

    replay: torch.Tensor | None
    valid: torch.Tensor  # [B, S] bool
    n_valid: int
    tally: RouteTally | None
    record: bool
    apply: bool = True  # False: compare `replay` with the live routes (tally), route live
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k]

    def flat(self, grid: torch.Tensor, n: int) -> torch.Tensor:
        """The grid's rows for a forward over `n` tokens: the whole [B*S] grid, or its real tokens packed."""
        whole = grid.flatten(0, 1)
        if n == whole.shape[0]:
            return whole
        if n == self.n_valid:
            return whole.index_select(0, _real_positions(self.valid, n))
        raise RuntimeError(f"a MoE forward over {n} tokens matches neither the route grid ({whole.shape[0]}) nor its "
                           f"{self.n_valid} real tokens")


class _Hooks:
    """Forward hooks on every MoE router, active while a plan is set; the run's replay mode and route tally
    (`configure`)."""

    def __init__(self, layers: list[MoeLayer]) -> None:
        self.layers, self.plan = layers, None
        self.mode: str | None = None
        self.tally: RouteTally | None = None
        self.select = None  # the backend's vendor top-k (`Backend.moe_topk`), else transformers' own
        self.handles = [layer.gate.register_forward_hook(self._hook(layer)) for layer in layers]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, layer: MoeLayer):
        def hook(module, args, output):
            plan = self.plan
            vendor = self.select is not None and layer.layout == "router"
            if plan is None and not vendor:
                return None
            logits = output[0] if layer.layout == "router" else output
            live = output[2] if layer.layout == "router" else live_topk(logits, layer.top_k)
            if vendor:  # the backend's op picks the experts; their weights come from the live softmax
                live = self.select(logits, layer.top_k)
                output = (logits, replayed_weights(logits, live, layer.norm_topk_prob), live)
            if plan is not None and plan.record:
                plan.recorded[layer.index] = live.detach().to(ROUTE_DTYPE)
            if plan is None or plan.replay is None or (not plan.apply and plan.tally is None):
                return output if vendor else None
            given = plan.flat(plan.replay[:, :, layer.index], logits.shape[0]).long()
            known = given[:, 0] >= 0
            chosen = torch.where(known[:, None], given, live)
            if plan.tally is not None:
                rows = known & plan.flat(plan.valid[..., None], logits.shape[0])[:, 0]
                plan.tally.add((same_experts(live, chosen) & rows).sum(), rows.sum())
            if not plan.apply:
                return output if vendor else None
            if layer.layout == "router":
                return logits, replayed_weights(logits, chosen, layer.norm_topk_prob), chosen
            # transformers 4.x: the block takes top-k of softmax(logits) itself; logits masked to the chosen experts
            # give it exactly those, weighted by the renormalised live probabilities
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, chosen, True) | ~known[:, None]
            return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
        return hook


def refuse_replay_problem(model, mode: str | None) -> str | None:
    """Why `actor.router_replay=mode` cannot run on this model, in one sentence; None when it can."""
    if mode is None:
        return None
    if mode not in REPLAY_MODES:
        return f"actor.router_replay={mode!r} is not a router replay mode; use null, R2 or R3."
    layers = moe_layers(model)
    if not layers:
        return (f"actor.router_replay={mode} replays a mixture-of-experts router, and this policy has none; set "
                f"actor.router_replay=null.")
    bad = [m for m in layers if m.layout == "linear" and not m.norm_topk_prob]
    if bad:
        return (f"actor.router_replay={mode} on transformers {_tf_version()} replays only routers that renormalise "
                f"their top-k (norm_topk_prob=true), and this model's do not; upgrade to transformers 5, or set "
                f"actor.router_replay=null.")
    return None


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _hooks_of(model) -> _Hooks | None:
    """The router hooks of `model`, installed once (kept on the transformers model itself); None for a dense model."""
    lm = base_lm(model)
    hooks = lm.__dict__.get("_portagrpo_route_hooks")
    if hooks is None:  # looked for once per model (False: a dense one)
        layers = moe_layers(lm)
        hooks = lm.__dict__["_portagrpo_route_hooks"] = _Hooks(layers) if layers else False
    return hooks or None


@contextlib.contextmanager
def routing(model, *, valid: torch.Tensor, n_valid: int, replay: torch.Tensor | None = None, record: bool = False,
            tally: RouteTally | None = None, apply: bool = True) -> Iterator[_Plan | None]:
    """Around one forward of `model` over the grid `valid` ([B, S] bool, the real tokens): replay `replay` ([B, S, L,
    k], -1 = live) and/or record the live routes; `tally` counts where the live router agreed with `replay`.
    Yields the plan (its `recorded` routes by layer after the forward), or None for a dense model."""
    hooks = _hooks_of(model) if (replay is not None or record) else None
    if hooks is None:
        yield None
        return
    plan = _Plan(replay, valid, n_valid, tally, record, apply=apply)
    previous, hooks.plan = hooks.plan, plan
    try:
        yield plan
    finally:
        hooks.plan = previous


def grid_of(plan: _Plan, shape: tuple[int, int]) -> torch.Tensor:
    """The recorded routes of one forward over the [B, S] grid (packed forwards: -1 at padding) as [B, S, L, k]."""
    layers = [plan.recorded[i] for i in sorted(plan.recorded)]
    stacked = torch.stack(layers, dim=1)  # [N, L, k]
    b, s = shape
    if stacked.shape[0] == b * s:
        return stacked.view(b, s, *stacked.shape[1:])
    out = stacked.new_full((b * s, *stacked.shape[1:]), -1)
    out[_real_positions(plan.valid, stacked.shape[0])] = stacked
    return out.view(b, s, *stacked.shape[1:])


def widen(routes: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """A route grid with `left` unknown (-1) columns before and `right` after: a trimmed forward's routes back on
    the batch's grid."""
    if left == 0 and right == 0:
        return routes
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=-1)


class GenerationRoutes:
    """Records the routes of every forward of a transformers `generate` and assembles them on the rollout's grid:
    the prompt's columns from the prefill (a prefill shared by a group's repeats is taken per distinct prompt),
    then one column per generated token fed back in. The last generated token is never fed in: its column, and
    every column past the end of generation, stays -1 (no later token depends on its route)."""

    def __init__(self, model) -> None:
        from portagrpo.model.loading import decoder_of

        self.hooks = _hooks_of(model)
        self.decoder = decoder_of(base_lm(model))
        self.calls: list[tuple[int, int, _Plan]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator["GenerationRoutes"]:
        if self.hooks is None:
            yield self
            return
        handle = self.decoder.register_forward_pre_hook(self._start, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
            self.hooks.plan = None

    def _start(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        b, s = x.shape[0], x.shape[1]
        plan = _Plan(None, torch.ones(b, s, dtype=torch.bool), b * s, None, True)
        self.calls.append((b, s, plan))
        self.hooks.plan = plan

    def grid(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, width: int) -> torch.Tensor | None:
        """[B, width, L, k] on the rollout's grid (prompt columns, then response columns); None for a dense model."""
        if self.hooks is None or not self.calls:
            return None
        rows = prompt_ids.shape[0]
        layers = len(self.hooks.layers)
        k = self.hooks.layers[0].top_k
        out = torch.full((rows, width, layers, k), -1, dtype=ROUTE_DTYPE, device=prompt_ids.device)
        column = 0
        for b, s, plan in self.calls:
            if column >= width:
                break
            r = grid_of(plan, (b, s)).to(prompt_ids.device)
            if b != rows:  # a prefill over the distinct prompts (engines.py: _shared_prefill), copied to repeats
                both = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
                r = r.index_select(0, torch.unique(both, dim=0, return_inverse=True)[1])
            s = min(s, width - column)
            out[:, column:column + s] = r[:, :s]
            column += s
        return out


def check_routes(routes: torch.Tensor, model, field_name: str = "routes") -> None:
    """A route grid fits this model: L MoE layers, top-k, expert ids in range (a record from another model is
    refused in one sentence)."""
    layers = moe_layers(model)
    if routes.shape[2] != len(layers) or routes.shape[3] != layers[0].top_k:
        raise UserError(f"{field_name} hold {routes.shape[2]} layers x top-{routes.shape[3]} routes, and this model "
                        f"has {len(layers)} MoE layers x top-{layers[0].top_k}; replay them on the model that "
                        f"made them.")


def fit_experts_to_dtype(model, choice: str = "grouped_mm") -> None:
    """How transformers 5 runs the packed experts: the backend's `choice` (BackendSpec.moe_experts), except that an
    fp64 model (the parity reference, model.dtype=fp64) runs them eagerly (`torch._grouped_mm` takes fp32, bf16 and
    fp16 only). transformers 4.x has one module per expert and no choice to make."""
    lm = base_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not moe_layers(lm) or not hasattr(config, "_experts_implementation"):
        return
    fp64 = any(p.dtype == torch.float64 for p in lm.parameters())
    config._experts_implementation = "eager" if fp64 else choice


def configure(model, mode: str | None, tally: RouteTally | None, experts: str = "grouped_mm", select=None) -> None:
    """A MoE model as the run and its backend want it: the router replay (`actor.router_replay`, the policy's), where
    its forwards count the routes they agree on with the batch's (`moe/route_agreement`), how its experts run
    (`experts`: BackendSpec.moe_experts) and which op picks its experts (`select`: Backend.moe_topk, None:
    transformers' own). A dense model with mode null: nothing to do."""
    problem = refuse_replay_problem(model, mode)
    if problem:
        raise UserError(problem)
    fit_experts_to_dtype(model, experts)
    hooks = _hooks_of(model) if moe_layers(model) else None
    if hooks is not None:
        hooks.mode, hooks.tally, hooks.select = mode, tally, select


def scoring(scorer, batch, trimmed, n_valid: int) -> contextlib.AbstractContextManager:
    """Around a scorer's forward over `trimmed` (`batch` with its all-padding columns dropped), for the policy's MoE
    routers: R3 replays the batch's routes (the sampler's) in every forward; R2 records the old policy's routes in
    the scoring pass (no gradient) into `batch.routes` and replays them in the update; otherwise the batch's routes
    are only compared with the live ones (the tally). A reference scorer (LoRA's adapters-off view included), a
    dense model, or nothing to replay, record or compare: nothing."""
    hooks = None if hasattr(scorer, "scorer") else _hooks_of(scorer)
    if hooks is None:
        return contextlib.nullcontext()
    grad = torch.is_grad_enabled()
    if hooks.mode == "R3" and batch.routes is None:
        raise UserError("actor.router_replay=R3 replays the sampler's experts, and this step's batch came without "
                        "them (a multi-turn conversation's batch carries no routes yet); set actor.router_replay=null.")
    record = hooks.mode == "R2" and not grad
    if batch.routes is None and not record or (hooks.mode is None and hooks.tally is None):
        return contextlib.nullcontext()
    p0 = batch.prompt_len - trimmed.prompt_len
    width = trimmed.prompt_len + trimmed.responses.shape[1]
    given = None if batch.routes is None else batch.routes[:, p0:p0 + width]
    replay_old = hooks.mode == "R2" and grad and hooks.tally is not None and hooks.tally.old_routes
    apply = hooks.mode == "R3" or replay_old
    return _scoring(scorer, batch, trimmed, n_valid, given, apply, record, hooks.tally, (p0, p0 + width))


@contextlib.contextmanager
def _scoring(scorer, batch, trimmed, n_valid, given, apply, record, tally, columns):
    valid = trimmed.attention_mask.bool()
    with routing(scorer, valid=valid, n_valid=n_valid, replay=given, tally=tally, apply=apply, record=record) as plan:
        yield plan
    if record and plan is not None and plan.recorded:
        full = batch.prompt_len + batch.responses.shape[1]
        batch.routes = widen(grid_of(plan, tuple(valid.shape)), columns[0], full - columns[1])
        if tally is not None:
            tally.old_routes = True


def in_row_order(scorer, parts: list, order: list[int], device) -> torch.Tensor | None:
    """R2: the old policy's routes the scoring pass recorded into each micro-batch (`parts`, rows `order`), as one
    grid in row order; None where the scorer's run records none."""
    hooks = None if hasattr(scorer, "scorer") else _hooks_of(scorer)
    if hooks is None or hooks.mode != "R2" or any(p.routes is None for p in parts):
        return None
    routes = torch.cat([p.routes for p in parts])
    if order == sorted(order):
        return routes
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return routes.index_select(0, torch.tensor(back, dtype=torch.long).to(device, non_blocking=True))


def route_metrics(tally: RouteTally, comm) -> dict[str, float] | None:
    """`moe/route_agreement`: the share of (token, layer) top-k decisions of the step's policy forwards that chose
    the same experts as the batch's routes (the sampler's, R2: the old policy's); None when nothing was compared.
    # host read: one per step, with routes"""
    share = tally.take(comm)
    return None if share is None else {"moe/route_agreement": share}


ENGINES_WITH_ROUTES = ("hf", "vllm")  # the hf engine records its routes; vLLM returns them (rollout/vllm.py)


def refuse_r3_engine(mode: str | None, engine: str) -> None:
    """R3 replays the experts the sampler chose, so the engine must say which: the hf engine records them, vLLM
    returns them with `enable_return_routed_experts` (a build that cannot, its CPU build, refuses when the engine is
    built: `vllm_routes_refused`); the others do not."""
    if mode == "R3" and engine not in ENGINES_WITH_ROUTES:
        raise UserError(f"actor.router_replay=R3 replays the experts the sampler chose, and rollout.engine={engine} "
                        f"does not say which it chose; use rollout.engine=hf or vllm, or actor.router_replay=R2.")


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


def moe_decoder_indices(model) -> list[int]:
    """The decoder-layer index of each MoE layer, in order (an engine that reports every layer, vLLM, is read at
    these)."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        block = getattr(layer, "mlp", None)
        if getattr(block, "gate", None) is not None and getattr(block, "experts", None) is not None:
            out.append(i)
    return out


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


PACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def per_expert_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with transformers 5's packed experts split into the per-expert tensors of a Hugging Face
    checkpoint, the names every vLLM MoE loader takes (a hub checkpoint's): `<layer>.mlp.experts.gate_up_proj`
    [E, 2I, H] gives `experts.<e>.gate_proj.weight` (rows :I) and `experts.<e>.up_proj.weight` (rows I:),
    `experts.down_proj` [E, H, I] gives `experts.<e>.down_proj.weight`. Views, no copies; other pairs pass through."""
    for name, tensor in named:
        if name.endswith(PACKED_EXPERTS[0]) and tensor.dim() == 3:
            prefix, half = name[:-len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith(PACKED_EXPERTS[1]) and tensor.dim() == 3:
            prefix = name[:-len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def packed_experts(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A state dict in a hub checkpoint's per-expert layout (what transformers 5's `save_pretrained` writes, and
    `per_expert_names` sends) with each layer's experts packed again as `model` holds them (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]); unchanged for a model without packed experts or a packed state."""
    wanted = {n: tuple(p.shape) for n, p in model.state_dict().items() if n.endswith(PACKED_EXPERTS) and p.dim() == 3}
    if not wanted or all(n in state for n in wanted):
        return state
    out = dict(state)
    for name, shape in wanted.items():
        prefix = name[:name.rindex(".") + 1]  # "<layer>.mlp.experts."
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        keys = [[f"{prefix}{e}.{part}.weight" for part in parts] for e in range(shape[0])]
        if not all(k in out for row in keys for k in row):
            continue  # left missing: the caller's check names it
        out[name] = torch.stack([torch.cat([out.pop(k) for k in row]) for row in keys])
    return out

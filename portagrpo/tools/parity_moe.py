"""The parity suite's mixture-of-experts stage (tools/parity.py runs it with the others).

A tiny Qwen3-MoE (4 experts, top-2, 2 layers; transformers 5's packed experts) scores fixed rows, then one on-policy
update's loss is differentiated, twice: routing live, and replaying fixed routes (model/router_replay.py, as
`actor.router_replay=R3` does) in which about a third of the (token, layer) decisions name other experts than the
live router takes, so a replay that is ignored, misplaced or weighed wrongly fails. Compared: log-probs, the routers'
gradients and the experts' gradients (apart, so a broken expert path cannot hide under the rest), with and without
replay. The scenario's seed is one whose every live routing decision clears the next expert by a wide logit margin
(`MIN_MARGIN`), so bf16's rounding routes as fp64 does on the live stage too.

Its fixtures are files of their own (moe_scenario.safetensors, moe_golden.safetensors): regenerating them leaves the
other stages' fixtures alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from portagrpo import algo
from portagrpo.algo.objective import Objective, Shaping, shape_and_advantage, total_loss
from portagrpo.batch import RolloutBatch
from portagrpo.kernels import logprob_impl
from portagrpo.model import moe
from portagrpo.model.router_replay import RouterHooks, Routing, grid_of
from portagrpo.model.scorer import ResponseScorer, response_stats

SCENARIO_FILE = "moe_scenario.safetensors"
GOLDEN_FILE = "moe_golden.safetensors"
QUANTITY = {"moe/logprob": "logprob", "moe/logprob_replay": "logprob", "moe/grad/router": "grad",
            "moe/grad/experts": "grad", "moe/grad/router_replay": "grad", "moe/grad/experts_replay": "grad"}
STAGES = set(QUANTITY)
WEIGHTS = "moe.policy."
PROMPT_LEN = [5, 5, 3, 3, 4, 4, 5, 5]
RESPONSE_LEN = [6, 2, 5, 6, 4, 6, 1, 3]
SCORES = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 1.0]
MIN_MARGIN = 0.05  # logits: the k-th chosen expert over the best one left out, on every real token
FLIPPED_SHARE = 3  # one (token, layer) decision in this many replays another expert


def moe_unavailable() -> str | None:
    """Why this stack cannot run the MoE stage against its fp64 golden, or None."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        return None
    return (f"skipped on transformers {transformers.__version__}: 4.x keeps one module per expert and takes the "
            f"router's softmax in fp32 even in an fp64 model, so it cannot reproduce the fp64 golden of the packed "
            f"experts (MoE training itself runs there: tests/unit/test_moe_routing.py)")


def _tiny():
    from portagrpo.config.schema import TinyModelConfig

    return TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, tie_word_embeddings=False,
                           moe="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _tokenizer():
    from portagrpo.model.loading import build_char_tokenizer

    return build_char_tokenizer()


def _build(seed: int):
    from portagrpo.model.loading import build_tiny_moe_model

    return build_tiny_moe_model(_tiny(), _tokenizer(), seed)


def moe_model(scn: dict[str, torch.Tensor], device: torch.device, master: torch.dtype, replay: str | None = None,
              experts: str = "grouped_mm") -> torch.nn.Module:
    """The scenario's policy, as the trainer configures it (model/moe.py: `configure_experts`)."""
    model = _build(0)
    model.config._attn_implementation = "sdpa"
    model.load_state_dict({k[len(WEIGHTS):]: v for k, v in scn.items() if k.startswith(WEIGHTS)})
    model = model.to(device=device, dtype=master)
    moe.configure_experts(model, replay, experts)
    return model


def _padded(lengths: list[int], width: int, left: bool) -> torch.Tensor:
    pos = torch.arange(width).unsqueeze(0)
    n = torch.tensor(lengths).unsqueeze(1)
    return (pos >= width - n).long() if left else (pos < n).long()


def _rollout(scn: dict[str, torch.Tensor], device: torch.device, master: torch.dtype, replay: bool) -> RolloutBatch:
    get = lambda k: scn["moe." + k]  # noqa: E731
    lengths = list(zip(get("prompt_mask").sum(1).tolist(), get("response_mask").sum(1).tolist()))
    return RolloutBatch(prompt_ids=get("prompt_ids").to(device), prompt_mask=get("prompt_mask").to(device),
                        responses=get("responses").to(device), response_mask=get("response_mask").to(device, master),
                        uid=get("uid").to(device), prompt_index=get("uid").to(device), response_text=[],
                        ground_truth=[], data_source=[], extra_info=[], lengths=lengths,
                        routes=get("routes").to(device) if replay else None)


def _live_routes(model, rb: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 model's own routes over the batch's grid, and each decision's logit margin (the k-th chosen expert's
    logit over the best one left out)."""
    from portagrpo.model.loading import position_ids_from_mask

    mask = rb.attention_mask
    margins: list[torch.Tensor] = []
    hooks = [layer.gate.register_forward_hook(
        lambda mod, args, out: margins.append(out[0].detach().sort(-1, descending=True).values))
        for layer in moe.moe_layers(model)]
    routers = RouterHooks.install(model)
    try:
        with torch.no_grad(), routers.forward(None, mask.bool(), int(mask.sum()), record=True) as fwd:
            model(input_ids=rb.input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    finally:
        for h in hooks:
            h.remove()
        routers.remove()
    k = moe.moe_layers(model)[0].top_k
    gap = torch.stack([m[:, k - 1] - m[:, k] for m in margins], dim=1).view(*mask.shape, -1)
    return grid_of(fwd, tuple(mask.shape)), gap[mask.bool()]


def moe_scenario(seed: int) -> dict[str, torch.Tensor]:
    """Rows, scores, weights (the first model seed whose live routes clear MIN_MARGIN) and the replayed routes."""
    g = torch.Generator().manual_seed(seed + 43)
    b, p, t = len(PROMPT_LEN), max(PROMPT_LEN), max(RESPONSE_LEN)
    prompt_mask, response_mask = _padded(PROMPT_LEN, p, left=True), _padded(RESPONSE_LEN, t, left=False)
    v = len(_tokenizer())
    out: dict[str, Any] = {
        "moe.prompt_ids": torch.randint(4, v, (b, p), generator=g) * prompt_mask, "moe.prompt_mask": prompt_mask,
        "moe.responses": torch.randint(4, v, (b, t), generator=g) * response_mask, "moe.response_mask": response_mask,
        "moe.scores": torch.tensor(SCORES, dtype=torch.float64), "moe.uid": torch.arange(2).repeat_interleave(4)}
    for model_seed in range(seed, seed + 200):
        weights = {WEIGHTS + k: v.clone() for k, v in _build(model_seed).state_dict().items()}
        model = moe_model({**out, **weights}, torch.device("cpu"), torch.float64)
        live, margin = _live_routes(model, _rollout(out, torch.device("cpu"), torch.float64, replay=False))
        if margin.min() >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"no model seed in {seed}..{seed + 199} routes with a margin of {MIN_MARGIN}")
    out.update(weights)
    flip = torch.randint(0, FLIPPED_SHARE, live.shape[:3], generator=g) == 0
    shifted = live.clone()
    shifted[..., 0] = (live[..., 0] + torch.randint(1, 4, live.shape[:3], generator=g)) % 4
    clash = shifted[..., 0] == shifted[..., 1]
    shifted[..., 0] = torch.where(clash, (shifted[..., 0] + 1) % 4, shifted[..., 0])
    clash = shifted[..., 0] == shifted[..., 1]
    shifted[..., 0] = torch.where(clash, (shifted[..., 0] + 1) % 4, shifted[..., 0])
    routes = torch.where(flip[..., None], shifted, live)
    valid = torch.cat([prompt_mask, response_mask], 1).bool()
    out["moe.routes"] = torch.where(valid[..., None, None], routes, torch.full_like(routes, -1))
    return out


def _grads(model) -> tuple[torch.Tensor, torch.Tensor]:
    router, experts = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        flat = p.grad.detach().double().reshape(-1).cpu()
        if name.endswith("mlp.gate.weight"):
            router.append(flat)
        elif ".experts." in name:
            experts.append(flat)
    return torch.cat(router), torch.cat(experts)


def _one_pass(scn, s, objective: Objective, temperature: float, replay: bool) -> tuple[torch.Tensor, ...]:
    # as actor.router_replay=R3 configures the policy: its forwards replay the batch's routes
    mode = "R3" if replay else None
    model = moe_model(scn, s.device, s.master, mode, s.moe_experts)
    rb = _rollout(scn, s.device, s.master, replay)
    scorer = ResponseScorer(model, logprob_impl(s.kernel), routers=RouterHooks.install(model, s.moe_topk))
    stats = response_stats(scorer, rb, temperature=temperature, compute_entropy=True, autocast=s.autocast,
                           routing=Routing.update(mode, old_routes=False))
    mask = rb.trained_mask
    _, adv = shape_and_advantage(scn["moe.scores"].to(s.device, s.master), rb.uid, mask,
                                 Shaping(adv_estimator="grpo", norm_by_std=True))
    n_tok, n_seq = algo.loss_normalizers(mask)
    loss, _ = total_loss(stats.logp, stats.logp.detach(), adv, mask, objective, num_tokens=n_tok, num_seqs=n_seq,
                         entropy=stats.entropy)
    loss.backward()
    return (stats.logp, *_grads(model))


def moe_stages(scn: dict[str, torch.Tensor], s, objective: Objective, temperature: float) -> dict[str, torch.Tensor]:
    """Log-probs and the routers' and experts' gradients of one on-policy update, routing live and replayed."""
    out = {}
    for replay, suffix in ((False, ""), (True, "_replay")):
        logp, router, experts = _one_pass(scn, s, objective, temperature, replay)
        out.update({f"moe/logprob{suffix}": logp, f"moe/grad/router{suffix}": router,
                    f"moe/grad/experts{suffix}": experts})
    return out


def regenerate(data_dir: Path, seed: int, reference_setting, objective: Objective, temperature: float) -> None:
    """The MoE scenario and its fp64 CPU golden, into `data_dir`."""
    from safetensors.torch import load_file, save_file

    if moe_unavailable() is not None:
        return
    data_dir = Path(data_dir)
    save_file({k: v.contiguous() for k, v in moe_scenario(seed).items()}, str(data_dir / SCENARIO_FILE))
    golden = moe_stages(load_file(str(data_dir / SCENARIO_FILE)), reference_setting, objective, temperature)
    save_file({k: v.detach().double().cpu().contiguous() for k, v in golden.items()}, str(data_dir / GOLDEN_FILE),
              metadata={"what": "float64 CPU reference outputs of portagrpo.tools.parity_moe.moe_stages"})

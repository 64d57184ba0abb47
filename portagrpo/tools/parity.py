"""The parity suite: a fixed scenario replayed on any backend and compared, stage by stage,
with float64 CPU golden outputs stored in the package (`portagrpo/tools/parity_data/`). The multi-turn
(tool spans under the model mask) and vision-language (images) stages are in tools/parity_stages.py.

No sampling enters: token ids, masks, rewards, old/reference log-probs and a tiny model's
weights are fixtures. `python -m portagrpo.tools.parity --regenerate` rebuilds them; the test suite
checks that rebuilding reproduces the stored numbers.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from portagrpo import algo
from portagrpo.algo.objective import Objective, Shaping, shape_and_advantage, total_loss
from portagrpo.algo.rollout_correction import is_weights
from portagrpo.errors import UserError
from portagrpo.kernels import logprob_impl
from portagrpo.model.scorer import ResponseScorer
from portagrpo.tolerances import DTYPES, relative_error, tolerance
from portagrpo.tools import parity_moe, parity_stages

DATA_DIR = Path(__file__).resolve().parent / "parity_data"
SCENARIO_FILE = "scenario.safetensors"
GOLDEN_FILE = "golden.safetensors"
MODEL_CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ["k1", "abs", "k2", "k3", "full"]
CLIP = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
TEMPERATURE = 0.9
ROLLOUT_IS_THRESHOLD = 2.0
LOSS_SCALE = 7.0
OPT_STEPS = 3


def _tolerance(stage: str, dtype: torch.dtype) -> float:
    """The stage's bound: its quantity's tolerance in `dtype`, or 0 for a stage that holds exactly."""
    if stage in parity_stages.EXACT:
        return 0.0
    return tolerance(dtype, parity_stages.QUANTITY.get(stage) or parity_moe.QUANTITY.get(stage) or _quantity(stage))


def _quantity(stage: str) -> str:
    head = stage.split("/")[0]
    return {"adv": "advantage", "logprob": "logprob", "entropy": "entropy", "loss_policy": "loss", "kl": "kl",
            "rollout_is": "logprob",  # exp(log-ratio): its relative error is the log-probs' absolute one
            "total_loss": "loss", "grad_norm": "grad_norm", "params_after_3_steps": "params"}[head]


# ---------------------------------------------------------------- the scenario


def build_scenario(seed: int = 1234) -> dict[str, torch.Tensor]:
    """Deterministic inputs: 3 groups of 4 responses (untied, all tied, partly tied scores),
    ragged left-padded prompts and right-padded responses, old/ref log-probs, policy and
    reference weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    b, p, t, v = 12, 6, 7, MODEL_CONFIG["vocab_size"]
    prompt_len = torch.tensor([6, 6, 6, 6, 3, 3, 3, 3, 5, 5, 5, 5])
    resp_len = torch.tensor([7, 1, 4, 6, 2, 7, 3, 5, 7, 7, 2, 4])
    prompt_mask = (torch.arange(p).unsqueeze(0) >= (p - prompt_len).unsqueeze(1)).long()
    response_mask = (torch.arange(t).unsqueeze(0) < resp_len.unsqueeze(1)).long()
    prompt_ids = torch.randint(3, v, (b, p), generator=g) * prompt_mask
    responses = torch.randint(3, v, (b, t), generator=g) * response_mask
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    uid = torch.arange(3).repeat_interleave(4)
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "responses": responses,
           "response_mask": response_mask, "scores": scores, "uid": uid}
    for name in ("policy", "ref"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + (0 if name == "policy" else 1))
            model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).float()
        for key, value in model.state_dict().items():
            out[f"{name}.{key}"] = value.clone()
    # old log-probs: the fp64 policy's, moved so that ratios leave the clip range on some tokens
    logp, _ = _token_stats(_model(out, "policy", torch.device("cpu"), torch.float64), out, "reference",
                           torch.device("cpu"), contextlib.nullcontext, entropy=False)
    noise = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    out["old_logp"] = (logp + noise) * response_mask
    ref_logp, _ = _token_stats(_model(out, "ref", torch.device("cpu"), torch.float64), out, "reference",
                               torch.device("cpu"), contextlib.nullcontext, entropy=False)
    out["ref_logp"] = ref_logp * response_mask
    # the multi-turn and vision-language stages' inputs, drawn from generators of their own
    fp64_cpu = (torch.device("cpu"), torch.float64)
    out.update(parity_stages.multi_turn_scenario(seed, lambda name: _model(out, name, *fp64_cpu), TEMPERATURE))
    out.update(parity_stages.vlm_scenario(seed))
    return out


def _model(scn: dict[str, torch.Tensor], name: str, device: torch.device, master: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_CONFIG)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    state = {k[len(name) + 1:]: v for k, v in scn.items() if k.startswith(name + ".")}
    model.load_state_dict(state)
    return model.to(device=device, dtype=master)


def _scorer(model, kernel: str) -> ResponseScorer:
    return ResponseScorer(model, logprob_impl(kernel))


def _batch(scn, device, rows=None):
    # Fixtures live on the host; move them first, then index with `rows` (which is on `device`).
    idx = slice(None) if rows is None else rows
    prompt_ids, prompt_mask = scn["prompt_ids"].to(device)[idx], scn["prompt_mask"].to(device)[idx]
    responses, rmask = scn["responses"].to(device)[idx], scn["response_mask"].to(device)[idx]
    return (torch.cat([prompt_ids, responses], 1), torch.cat([prompt_mask, rmask], 1), responses, rmask.bool())


def _token_stats(model, scn, kernel, device, autocast, entropy=True, vocab=False, rows=None):
    ids, attn, responses, rmask = _batch(scn, device, rows)
    logp, ent, logp_vocab, _ = _scorer(model, kernel)(ids, attn, responses, rmask, TEMPERATURE, entropy, vocab,
                                                      autocast)
    return (logp, ent) if not vocab else (logp, ent, logp_vocab)


# ---------------------------------------------------------------- the stages


@dataclass
class Setting:
    device: torch.device
    dtype: str  # fp64 | fp32 | bf16
    kernel: str
    autocast: Callable[[], Any]
    moe_experts: str = "grouped_mm"  # the backend's answers for a mixture-of-experts model (tools/parity_moe.py)
    moe_topk: Callable | None = None

    @property
    def master(self) -> torch.dtype:
        return torch.float64 if self.dtype == "fp64" else torch.float32


# The objective the parity suite checks: policy (token-mean) + 0.1 x k3 KL - 0.01 x entropy, through
# the same algo.objective functions the trainer calls.
OBJECTIVE = Objective(**CLIP, loss_agg_mode="token-mean", loss_scale_factor=LOSS_SCALE, kl_loss_type="k3",
                      kl_loss_coef=0.1, entropy_coeff=0.01)


def _total_loss(model, scn, s: Setting, adv, rows=None, normalizers=None):
    """The trainer's total loss on `rows` with the given global counts."""
    mask = scn["response_mask"].to(s.device).to(s.master)
    old, ref = scn["old_logp"].to(s.device, s.master), scn["ref_logp"].to(s.device, s.master)
    if rows is not None:
        mask, old, ref, adv = mask[rows], old[rows], ref[rows], adv[rows]
    logp, ent = _token_stats(model, scn, s.kernel, s.device, s.autocast, rows=rows)
    n_tok, n_seq = normalizers or algo.loss_normalizers(mask)
    loss, _ = total_loss(logp, old, adv, mask, OBJECTIVE, num_tokens=n_tok, num_seqs=n_seq, ref_logp=ref, entropy=ent)
    return loss


def compute_stages(scn: dict[str, torch.Tensor], s: Setting, vision: bool = True) -> dict[str, torch.Tensor]:
    """Every compared quantity, as float64 CPU tensors (the vision-language stages only with `vision`)."""
    out: dict[str, torch.Tensor] = {}
    mask = scn["response_mask"].to(s.device).to(s.master)
    scores = scn["scores"].to(s.device, s.master)
    uid = scn["uid"].to(s.device)
    _, adv = shape_and_advantage(scores, uid, mask, Shaping(adv_estimator="grpo", norm_by_std=True))
    out["adv/grpo"] = adv
    out["adv/drgrpo"] = shape_and_advantage(scores, uid, mask, Shaping(adv_estimator="grpo", norm_by_std=False))[1]
    policy = _model(scn, "policy", s.device, s.master)
    ref_model = _model(scn, "ref", s.device, s.master)
    with torch.no_grad():
        logp, ent = _token_stats(policy, scn, s.kernel, s.device, s.autocast)
        out["logprob"], out["entropy"] = logp, ent
        old = scn["old_logp"].to(s.device, s.master)
        ref = scn["ref_logp"].to(s.device, s.master)
        pg, _ = algo.clipped_policy_loss(logp, old, adv, mask, **CLIP)
        for mode in AGG_MODES:
            out[f"loss_policy/{mode}"] = algo.aggregate_loss(pg, mask, mode, loss_scale_factor=LOSS_SCALE)
        _, _, logp_vocab = _token_stats(policy, scn, s.kernel, s.device, s.autocast, entropy=False, vocab=True)
        _, _, ref_vocab = _token_stats(ref_model, scn, s.kernel, s.device, s.autocast, entropy=False, vocab=True)
        for name in KL_TYPES:
            kl = algo.kl_penalty(name, logp, ref, logp_vocab=logp_vocab, ref_logp_vocab=ref_vocab)
            out[f"kl/{name}"] = kl * mask  # per token: a mean of k1 cancels and would inflate relative errors
        # rollout correction (verl 0.9.1's semantics): the fixture's old log-probs play the sampler, this
        # backend's policy the trainer; truncated (TIS) weights, token and sequence level, and the loss they weight
        for level in ("token", "sequence"):
            weights, _ = is_weights(logp - old, mask, level, ROLLOUT_IS_THRESHOLD)
            out[f"rollout_is/{level}"] = weights
            out[f"loss_policy/rollout_is_{level}"] = algo.aggregate_loss(pg * weights, mask, "token-mean")
    loss = _total_loss(policy, scn, s, adv)
    loss.backward()
    out["total_loss"] = loss.detach()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    out["grad_norm"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    out["params_after_3_steps"] = _train_steps(scn, s, adv)
    out.update(parity_stages.multi_turn_stages(scn, s, _model(scn, "policy", s.device, s.master), OBJECTIVE,
                                               TEMPERATURE))
    if vision:
        out.update(parity_stages.vlm_stages(scn, s, OBJECTIVE, TEMPERATURE))
    return {k: v.detach().double().cpu() for k, v in out.items()}


def _train_steps(scn, s: Setting, adv) -> torch.Tensor:
    """3 AdamW steps, each accumulating 2 micro-batches with mini-batch normalisers, grad-clipped."""
    model = _model(scn, "policy", s.device, s.master)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    mask = scn["response_mask"].to(s.device).to(s.master)
    counts = algo.loss_normalizers(mask)
    halves = [torch.arange(0, 6), torch.arange(6, 12)]
    for _ in range(OPT_STEPS):
        opt.zero_grad()
        for rows in halves:
            _total_loss(model, scn, s, adv, rows=rows.to(s.device), normalizers=counts).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return torch.cat([p.detach().double().reshape(-1).cpu() for p in model.parameters()])


# ---------------------------------------------------------------- fixtures


def load_fixture(name: str, data_dir: Path = DATA_DIR) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(data_dir) / name
    if not path.is_file():
        raise FileNotFoundError(
            f"parity fixture {path} is missing; regenerate with `python -m portagrpo.tools.parity --regenerate`."
        )
    return load_file(str(path))


def regenerate(data_dir: Path = DATA_DIR) -> dict[str, torch.Tensor]:
    """Rebuild the scenario and its float64 CPU golden outputs into `data_dir`."""
    from safetensors.torch import save_file

    no_vision = parity_stages.vlm_unavailable()
    if no_vision is not None:
        raise UserError(f"the parity fixtures cannot be regenerated here: the vision-language stage is {no_vision}.")
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    scn = build_scenario()
    save_file({k: v.contiguous() for k, v in scn.items()}, str(data_dir / SCENARIO_FILE))
    golden = compute_stages(load_fixture(SCENARIO_FILE, data_dir), reference_setting())
    save_file({k: v.contiguous() for k, v in golden.items()}, str(data_dir / GOLDEN_FILE),
              metadata={"what": "float64 CPU reference outputs of portagrpo.tools.parity.compute_stages"})
    parity_moe.regenerate(data_dir, 1234, reference_setting(), OBJECTIVE, TEMPERATURE)
    return golden


def reference_setting() -> Setting:
    return Setting(torch.device("cpu"), "fp64", "reference", contextlib.nullcontext)


# ---------------------------------------------------------------- running it


@dataclass
class ParityRow:
    stage: str
    error: float
    tolerance: float
    skipped: str | None = None  # why this stack cannot run the stage (it neither passes nor fails then)

    @property
    def passed(self) -> bool:
        """Not failed: within tolerance, or skipped."""
        return self.skipped is not None or self.error <= self.tolerance


def run_parity(device: str, dtype: str, kernel: str) -> tuple[str, list[ParityRow]]:
    """Run the scenario on `device` with `dtype` and `kernel` (auto: the backend's); compare with the golden."""
    from portagrpo.backends import get_backend

    backend = get_backend(device)
    chosen = backend.kernel_implementation(kernel)
    tdtype = DTYPES[dtype]
    setting = Setting(backend.device(0), dtype, chosen, lambda: backend.autocast(tdtype), backend.spec.moe_experts,
                      backend.moe_topk())
    backend.set_deterministic(False)
    no_vision = parity_stages.vlm_unavailable()
    got = compute_stages(load_fixture(SCENARIO_FILE), setting, vision=no_vision is None)
    golden = load_fixture(GOLDEN_FILE) | load_fixture(parity_moe.GOLDEN_FILE)  # the MoE stage: tools/parity_moe.py
    no_moe = parity_moe.moe_unavailable()
    if no_moe is None:
        got.update({k: v.detach().double().cpu() for k, v in parity_moe.moe_stages(
            load_fixture(parity_moe.SCENARIO_FILE), setting, OBJECTIVE, TEMPERATURE).items()})
    rows = []
    for stage in golden:
        bound = _tolerance(stage, tdtype)
        if no_vision is not None and stage in parity_stages.VLM:
            rows.append(ParityRow(stage, math.nan, bound, skipped=no_vision))
        elif no_moe is not None and stage in parity_moe.STAGES:
            rows.append(ParityRow(stage, math.nan, bound, skipped=no_moe))
        else:
            rows.append(ParityRow(stage, relative_error(got[stage], golden[stage]), bound))
    return chosen, rows


def format_table(backend: str, dtype: str, kernel: str, rows: list[ParityRow]) -> str:
    lines = [f"parity: device {backend}, dtype {dtype}, kernel {kernel}",
             f"{'stage':34} {'rel. error':>11} {'tolerance':>10}  result"]
    for r in rows:
        result = "skipped" if r.skipped else "pass" if r.passed else "FAIL"
        lines.append(f"{r.stage:34} {'-' if r.skipped else f'{r.error:.3e}':>11} {r.tolerance:10.1e}  {result}")
    failed, skipped = sum(not r.passed for r in rows), sum(r.skipped is not None for r in rows)
    why = {r.skipped: r.stage.split("/")[0] for r in rows if r.skipped}
    lines += [f"{stage}/*: {reason}" for reason, stage in why.items()]
    tail = f", {skipped} skipped" if skipped else ""
    lines.append(f"{len(rows) - failed - skipped} passed, {failed} failed{tail}")
    return "\n".join(lines)


def to_json(backend: str, dtype: str, kernel: str, rows: list[ParityRow]) -> dict[str, Any]:
    from portagrpo.backends.probe import package_versions, torch_build

    return {
        "device": backend,
        "dtype": dtype,
        "kernel": kernel,
        "torch": torch_build(),
        "packages": package_versions(),
        "passed": all(r.passed for r in rows),
        "stages": [{"stage": r.stage, "error": None if r.skipped else r.error, "tolerance": r.tolerance,
                    "passed": r.passed, **({"skipped": r.skipped} if r.skipped else {})} for r in rows],
    }


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo parity")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp64; comma-separated for several")
    p.add_argument("--kernels", default="auto", help="auto, reference, chunked, triton; comma-separated for several")
    p.add_argument("--json", dest="json_path", help="write the report(s) here")
    args = p.parse_args(argv)
    from portagrpo.backends import get_backend
    from portagrpo.fileio import check_report_destination, write_report

    dtypes, kernels = args.dtype.split(","), args.kernels.split(",")
    for dtype in dtypes:  # every argument checked before any work
        if dtype not in DTYPES:
            raise UserError(f"--dtype {args.dtype!r}: {dtype!r} is not one of {', '.join(DTYPES)}; give one or more of "
                            f"them separated by commas, e.g. --dtype fp32,bf16.")
    if "" in kernels:
        raise UserError(
            f"--kernels {args.kernels!r} has an empty name; give names separated by commas, e.g. auto,chunked."
        )
    if args.json_path:
        check_report_destination(args.json_path, "--json", "parity")
    backend = get_backend(args.device).name
    reports, ok = [], True
    for dtype in dtypes:
        for kernel in kernels:
            chosen, rows = run_parity(backend, dtype, kernel)
            print(format_table(backend, dtype, chosen, rows))
            print()
            reports.append(to_json(backend, dtype, chosen, rows))
            ok &= all(r.passed for r in rows)
    if args.json_path:
        write_report(args.json_path, reports if len(reports) > 1 else reports[0], "parity")
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--regenerate"]:
        regenerate()
        print(f"wrote {DATA_DIR / SCENARIO_FILE} and {DATA_DIR / GOLDEN_FILE}")
    else:
        sys.exit(main_cli(sys.argv[1:]))

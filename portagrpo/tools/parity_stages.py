"""The parity suite's multi-turn and vision-language stages (tools/parity.py runs them with the others).

Multi-turn: responses that hold tool and template spans (`RolloutBatch.model_mask` 0 on them), scored, turned
into a `TrainBatch` by the trainer's `ExperienceMaker` and put through `total_loss` with the batch's trained
mask, as `Updater.micro_loss` does. Besides log-probs, advantages, the loss and the gradient, the gradient that
reaches the LM head at every tool/template token is recorded: it must be exactly 0 on every backend.

Vision-language: a tiny Qwen2.5-VL policy (model/vision.py) scores rows whose prompts show fixed random images
(two sizes, and a row without an image) through the scorer's image path (`PromptImages`: pixel_values and
image_grid_thw), then one on-policy update's loss is differentiated; the vision tower's gradient is compared
apart from the language model's, so a broken image path cannot hide under the larger text gradient.

Every input (token ids, masks, the processor's pixel values and grids, both models' weights) is a fixture.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch

from portagrpo import algo
from portagrpo.algo.objective import Objective, Shaping, shape_and_advantage, total_loss
from portagrpo.batch import RolloutBatch
from portagrpo.kernels import logprob_impl
from portagrpo.model.scorer import ResponseScorer, response_stats
from portagrpo.model.vision import VL_MIN_TRANSFORMERS as VISION_MIN

# stage -> the quantity whose tolerance it takes (portagrpo/tolerances.py)
QUANTITY = {"multi_turn/logprob": "logprob", "multi_turn/adv": "advantage", "multi_turn/total_loss": "loss",
            "multi_turn/grad": "grad", "vlm/logprob": "logprob", "vlm/entropy": "entropy",
            "vlm/grad/vision": "grad", "vlm/grad/language": "grad"}
# stages that hold exactly, in every dtype: no tolerance
EXACT = {"multi_turn/tool_span_grad"}
STAGES = set(QUANTITY) | EXACT
VLM = {stage for stage in STAGES if stage.startswith("vlm/")}
# the first transformers whose tiny Qwen2.5-VL computes what the golden's does (model/vision.py says why)
VL_MIN_TRANSFORMERS = VISION_MIN


class Setting(Protocol):
    """Where and how a stage runs (tools/parity.py: Setting)."""

    device: torch.device
    master: torch.dtype  # the weights' dtype
    kernel: str  # the log-prob kernel
    autocast: Callable[[], Any]


GRPO = Shaping(adv_estimator="grpo", norm_by_std=True)
FP64_CPU = (torch.device("cpu"), torch.float64)

# Multi-turn rows: (response length, tool/template spans [start, end) inside it). Two groups of four; row 3's
# tool reply runs to the end of its response (the length budget cut it), rows 1 and 6 are single-turn.
MT_ROWS = [(12, [(3, 7)]), (5, []), (11, [(2, 4), (6, 9)]), (9, [(5, 9)]),
           (12, [(1, 2)]), (7, [(4, 6)]), (10, []), (12, [(2, 5), (8, 10)])]
MT_PROMPT_LEN = [5, 5, 5, 5, 2, 2, 2, 2]
MT_SCORES = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]

# Vision-language: three prompts (an image of 56x56 pixels, one of 84x56, none), two responses each.
VL_IMAGES = [(56, 56), (84, 56), None]
VL_RESPONSE_LEN = [6, 3, 5, 6, 2, 4]
VL_SCORES = [1.0, 0.0, 0.5, 1.0, 0.0, 1.0]
VL_WEIGHTS = "vl.policy."
VL_SEED = 4321


def _vl_tiny():
    from portagrpo.config.schema import TinyModelConfig

    return TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                           tie_word_embeddings=False, vision=True)


def _padded(lengths: list[int], width: int, left: bool) -> torch.Tensor:
    pos = torch.arange(width).unsqueeze(0)
    n = torch.tensor(lengths).unsqueeze(1)
    return (pos >= width - n).long() if left else (pos < n).long()


def _rollout(scn: dict[str, torch.Tensor], prefix: str, device: torch.device, master: torch.dtype,
             images=None) -> RolloutBatch:
    """The fixture's rows as the trainer's RolloutBatch (float masks in the master dtype, as the loss takes them)."""
    get = lambda k: scn[prefix + k]  # noqa: E731
    lengths = list(zip(get("prompt_mask").sum(1).tolist(), get("response_mask").sum(1).tolist()))
    model_mask = get("model_mask").to(device, master) if prefix + "model_mask" in scn else None
    return RolloutBatch(prompt_ids=get("prompt_ids").to(device), prompt_mask=get("prompt_mask").to(device),
                        responses=get("responses").to(device), response_mask=get("response_mask").to(device, master),
                        uid=get("uid").to(device), prompt_index=get("uid").to(device), response_text=[],
                        ground_truth=[], data_source=[], extra_info=[], lengths=lengths, images=images,
                        model_mask=model_mask)


def _stats(model, rb: RolloutBatch, kernel, temperature: float, autocast=contextlib.nullcontext):
    return response_stats(ResponseScorer(model, kernel), rb, temperature=temperature, compute_entropy=True,
                          autocast=autocast)


def _flat_grads(params) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().reshape(-1).cpu() for p in params if p.grad is not None])


# ---------------------------------------------------------------- multi-turn


def multi_turn_scenario(seed: int, model: Callable[[str], torch.nn.Module],
                        temperature: float) -> dict[str, torch.Tensor]:
    """`model(name)`: the scenario's fp64 CPU policy or ref. Old and reference log-probs are scored over every
    response token, tool spans included (as the scoring pass does); old ones moved so some ratios clip."""
    g = torch.Generator().manual_seed(seed + 35)
    policy, ref_model = model("policy"), model("ref")
    b, p, t, v = len(MT_ROWS), max(MT_PROMPT_LEN), max(n for n, _ in MT_ROWS), policy.config.vocab_size
    prompt_mask = _padded(MT_PROMPT_LEN, p, left=True)
    response_mask = _padded([n for n, _ in MT_ROWS], t, left=False)
    model_mask = response_mask.clone()
    for row, (_, spans) in enumerate(MT_ROWS):
        for start, end in spans:
            model_mask[row, start:end] = 0
    out = {"mt.prompt_ids": torch.randint(3, v, (b, p), generator=g) * prompt_mask, "mt.prompt_mask": prompt_mask,
           "mt.responses": torch.randint(3, v, (b, t), generator=g) * response_mask,
           "mt.response_mask": response_mask, "mt.model_mask": model_mask,
           "mt.scores": torch.tensor(MT_SCORES, dtype=torch.float64), "mt.uid": torch.arange(2).repeat_interleave(4)}
    rb = _rollout(out, "mt.", *FP64_CPU)
    with torch.no_grad():
        logp = _stats(policy, rb, logprob_impl("reference"), temperature).logp
        ref = _stats(ref_model, rb, logprob_impl("reference"), temperature).logp
    out["mt.old_logp"] = (logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3) * rb.response_mask
    out["mt.ref_logp"] = ref * rb.response_mask
    return out


class HeadInputGrad:
    """A log-prob kernel that records the gradient reaching its hidden-state input, one row per scored token:
    the token's logit gradient times the LM head, exactly 0 for a token whose logits get no gradient."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grad = kernel, None

    def __call__(self, hidden, weight, targets, **kwargs):
        if hidden.requires_grad:
            hidden.register_hook(self._keep)
        return self.kernel(hidden, weight, targets, **kwargs)

    def _keep(self, grad: torch.Tensor) -> None:
        self.grad = grad.detach()


def _experience_maker():
    from portagrpo.config import load_config
    from portagrpo.train.experience import ExperienceMaker, ExperienceSettings

    return ExperienceMaker(ExperienceSettings.from_config(load_config(None, [])), GRPO)


def multi_turn_stages(scn: dict[str, torch.Tensor], s: Setting, policy: torch.nn.Module, objective: Objective,
                      temperature: float) -> dict[str, torch.Tensor]:
    """The trainer's update path on multi-turn rows: ExperienceMaker's TrainBatch, then the loss over its mask
    (the trained mask) as Updater.micro_loss computes it; and the LM head's input gradient on the tool tokens."""
    rb = _rollout(scn, "mt.", s.device, s.master)
    old, ref = scn["mt.old_logp"].to(s.device, s.master), scn["mt.ref_logp"].to(s.device, s.master)
    batch, _, _ = _experience_maker().train_batch(rb, scn["mt.scores"].to(s.device, s.master), old, ref)
    tap = HeadInputGrad(logprob_impl(s.kernel))
    stats = _stats(policy, batch.rollout, tap, temperature, s.autocast)
    n_tok, n_seq = algo.loss_normalizers(batch.mask)
    loss, _ = total_loss(stats.logp, batch.old_logp, batch.advantages, batch.mask, objective, num_tokens=n_tok,
                         num_seqs=n_seq, ref_logp=batch.ref_logp, entropy=stats.entropy)
    loss.backward()
    scored = scn["mt.response_mask"].bool()
    tool = (scored & ~scn["mt.model_mask"].bool())[scored]  # per scored token (the kernel's rows), row-major
    return {"multi_turn/logprob": stats.logp, "multi_turn/adv": batch.advantages, "multi_turn/total_loss": loss,
            "multi_turn/grad": _flat_grads(policy.parameters()),
            "multi_turn/tool_span_grad": tap.grad.cpu()[tool]}


# ---------------------------------------------------------------- vision-language


def vlm_unavailable() -> str | None:
    """Why this stack's transformers cannot run the vision-language stage against the golden, or None (the gate
    of model/vision.py, which refuses a vision-language policy there)."""
    from portagrpo.model.vision import transformers_version, vision_support_problem

    if vision_support_problem() is None:
        return None
    return (f"skipped on transformers {transformers_version()}: the vision-language stage needs {VL_MIN_TRANSFORMERS} "
            f"or newer (4.x lacks the Qwen2.5-VL API model/vision.py calls; up to 5.5.3 it placed a still image's "
            f"rotary positions as a video's)")


def _png(size: tuple[int, int], g: torch.Generator) -> bytes:
    import io

    from PIL import Image

    w, h = size
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def vlm_scenario(seed: int) -> dict[str, torch.Tensor]:
    """Random images through the tiny processor (its pixel values and grids are stored, so a backend's run
    needs no image library), prompts left-padded, responses right-padded, and the policy's weights."""
    from portagrpo.data.records import PromptRecord
    from portagrpo.model import vision

    g = torch.Generator().manual_seed(seed + 36)
    processor = vision.build_tiny_processor()
    records = [PromptRecord(i, [{"role": "user", "content": ("<image>" if size else "") + f"what is shown {i}?"}],
                            "", "parity", images=(_png(size, g),) if size else ())
               for i, size in enumerate(VL_IMAGES)]
    ids, images = vision.vision_prompts(processor, records, torch.device("cpu"))
    n = len(VL_RESPONSE_LEN) // len(records)
    p, t = max(len(x) for x in ids), max(VL_RESPONSE_LEN)
    prompt_ids = torch.tensor([[0] * (p - len(x)) + x for x in ids]).repeat_interleave(n, 0)
    response_mask = _padded(VL_RESPONSE_LEN, t, left=False)
    first_special = processor.tokenizer.convert_tokens_to_ids(vision.QWEN_VL_SPECIALS[0])  # plain characters below
    out = {"vl.prompt_ids": prompt_ids, "vl.prompt_mask": (prompt_ids != 0).long(),
           "vl.responses": torch.randint(4, first_special, (len(VL_RESPONSE_LEN), t), generator=g) * response_mask,
           "vl.response_mask": response_mask, "vl.scores": torch.tensor(VL_SCORES, dtype=torch.float64),
           "vl.uid": torch.arange(len(records)).repeat_interleave(n), "vl.pixel_values": images.pixel_values,
           "vl.image_grid_thw": images.grid_thw, "vl.patch_spans": torch.tensor(images.patch_spans),
           "vl.image_spans": torch.tensor(images.image_spans)}
    model = vision.build_tiny_vl_model(_vl_tiny(), processor.tokenizer, seed=VL_SEED)
    out.update({VL_WEIGHTS + k: v.clone() for k, v in model.state_dict().items()})
    return out


def vl_model(scn: dict[str, torch.Tensor], device: torch.device, master: torch.dtype) -> torch.nn.Module:
    from portagrpo.model import vision

    model = vision.build_tiny_vl_model(_vl_tiny(), vision.build_vl_tokenizer(), seed=VL_SEED)
    model.load_state_dict({k[len(VL_WEIGHTS):]: v for k, v in scn.items() if k.startswith(VL_WEIGHTS)})
    return model.to(device=device, dtype=master)


def vl_images(scn: dict[str, torch.Tensor], device: torch.device, master: torch.dtype):
    from portagrpo.model.vision import PromptImages

    spans = lambda k: [tuple(r) for r in scn[k].tolist()]  # noqa: E731
    n = len(VL_RESPONSE_LEN) // len(VL_IMAGES)
    return PromptImages(scn["vl.pixel_values"].to(device, master), scn["vl.image_grid_thw"].to(device),
                        spans("vl.patch_spans"), spans("vl.image_spans"),
                        [p for p in range(len(VL_IMAGES)) for _ in range(n)])


def vlm_stages(scn: dict[str, torch.Tensor], s: Setting, objective: Objective,
               temperature: float) -> dict[str, torch.Tensor]:
    """Log-probs, entropies, and the gradient of one on-policy update's loss (old log-probs: its own, detached, as
    the trainer's fully on-policy step; no reference)."""
    from portagrpo.model.vision import vision_tower

    model = vl_model(scn, s.device, s.master)
    rb = _rollout(scn, "vl.", s.device, s.master, images=vl_images(scn, s.device, s.master))
    stats = _stats(model, rb, logprob_impl(s.kernel), temperature, s.autocast)
    mask = rb.trained_mask
    _, adv = shape_and_advantage(scn["vl.scores"].to(s.device, s.master), rb.uid, mask, GRPO)
    n_tok, n_seq = algo.loss_normalizers(mask)
    loss, _ = total_loss(stats.logp, stats.logp.detach(), adv, mask, objective, num_tokens=n_tok,
                         num_seqs=n_seq, entropy=stats.entropy)
    loss.backward()
    tower = {id(p) for p in vision_tower(model).parameters()}
    return {"vlm/logprob": stats.logp, "vlm/entropy": stats.entropy,
            "vlm/grad/vision": _flat_grads(p for p in model.parameters() if id(p) in tower),
            "vlm/grad/language": _flat_grads(p for p in model.parameters() if id(p) not in tower)}

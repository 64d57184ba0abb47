"""A step's record for `portagrpo replay` (`trainer.record_rollouts=true`): its rollout tokens, rewards,
logged metrics and parameter fingerprint, written by the loop and read back by replay.

On disk a record is one `torch.save` dict (`rollouts/step_00000001.pt`): the rollout's tensors at its
top level beside `scores`, `correct`, `metrics`, `fingerprint` and `setting`, and for a vision-language step
`images`: its prompts' processed images, once per prompt, and which prompt each row shows (IMAGE_FIELDS), so the
step replays with the pixels it was trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from portagrpo.backends.dist import Collectives
from portagrpo.batch import RolloutBatch
from portagrpo.errors import UserError
from portagrpo.fileio import atomic_path
from portagrpo.model.vision import PromptImages

ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "responses", "response_mask", "uid", "prompt_index")
# the sampler's log-probs, when the engine reported them; the model's own tokens of a multi-turn rollout
OPTIONAL_TENSORS = ("rollout_logp", "model_mask", "routes")  # routes: a MoE policy's experts (model/router_replay.py)
# a vision-language step's images (model/vision.py: PromptImages), kept as they were processed
IMAGE_FIELDS = ("pixel_values", "grid_thw", "patch_spans", "image_spans", "row_prompt")


@dataclass
class StepRecord:
    rollout: dict[str, torch.Tensor]  # ROLLOUT_TENSORS of the global batch, on the host
    scores: torch.Tensor  # [B] the reward function's scores
    correct: torch.Tensor  # [B] 0/1
    metrics: dict[str, Any]  # exactly what the step logged
    fingerprint: dict[str, list[float]]  # per parameter (sum, sum of squares) after the step
    setting: dict[str, str]  # device, dtype and kernel that produced it
    images: dict[str, Any] | None = None  # IMAGE_FIELDS of the global batch, on the host; None: text only

    @property
    def step(self) -> int:
        return int(self.metrics["step"])

    def save(self, folder: Path) -> Path:
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{self.step:08d}.pt"
        payload = {**self.rollout, "scores": self.scores, "correct": self.correct, "metrics": self.metrics,
                   "fingerprint": self.fingerprint, "setting": self.setting}
        if self.images is not None:
            payload["images"] = self.images
        with atomic_path(path, what="recording the rollout to") as tmp:
            torch.save(payload, tmp)
        return path

    @classmethod
    def load(cls, path: Path) -> "StepRecord":
        try:
            raw = torch.load(path, weights_only=False)
            rollout = {k: raw[k] for k in ROLLOUT_TENSORS} | {k: raw[k] for k in OPTIONAL_TENSORS if k in raw}
            images = {k: raw["images"][k] for k in IMAGE_FIELDS} if raw.get("images") is not None else None
            return cls(rollout=rollout, scores=raw["scores"], correct=raw["correct"], metrics=raw["metrics"],
                       fingerprint=raw["fingerprint"], setting=raw.get("setting", {}), images=images)
        except (KeyError, TypeError, RuntimeError, EOFError) as err:
            raise UserError(f"{path} is not a whole rollout record ({type(err).__name__}: {err}); record the run "
                            f"again with trainer.record_rollouts=true.") from None

    def rollout_batch(self, device: torch.device) -> RolloutBatch:
        """The recorded global batch on `device` (token tensors and images only: no text is kept)."""
        r = self.rollout
        lengths = torch.stack([r["prompt_mask"].sum(1), r["response_mask"].sum(1).round().long()], dim=1)
        images = None if self.images is None else PromptImages(**self.images).to(device)
        return RolloutBatch(**{k: r[k].to(device) for k in ROLLOUT_TENSORS}, response_text=[], ground_truth=[],
                            data_source=[], extra_info=[], lengths=[(int(p), int(n)) for p, n in lengths.tolist()],
                            rollout_logp=r["rollout_logp"].to(device) if "rollout_logp" in r else None,
                            model_mask=r["model_mask"].to(device) if "model_mask" in r else None, images=images,
                            routes=r["routes"].to(device) if "routes" in r else None)


def record_of(rollout: RolloutBatch, scores: torch.Tensor, correct: torch.Tensor, metrics: dict[str, Any],
              fingerprint: dict[str, list[float]], setting: dict[str, str]) -> StepRecord:
    tensors = {k: getattr(rollout, k) for k in ROLLOUT_TENSORS + OPTIONAL_TENSORS if getattr(rollout, k) is not None}
    return StepRecord({k: v.detach().cpu() for k, v in tensors.items()}, scores.detach().cpu(),
                      correct.detach().cpu(), metrics, fingerprint, setting, images_of(rollout.images))


def images_of(images: PromptImages | None) -> dict[str, Any] | None:
    """A rollout's PromptImages as a record keeps them: the tensors on the host, the spans and rows as lists."""
    if images is None:
        return None
    host = images.to("cpu")
    return {k: (v.detach() if torch.is_tensor(v) else list(v)) for k in IMAGE_FIELDS for v in [getattr(host, k)]}


def param_fingerprint(scorer: torch.nn.Module, comm: Collectives) -> dict[str, list[float]]:
    """Per parameter tensor: (sum, sum of squares) in fp64. Both add up over shards, so the
    fingerprint is exact under FSDP2 too; replay compares it to measure parameter drift."""
    names, values = [], []
    for name, p in scorer.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        x = local.detach().double()
        names.append(name.removeprefix("lm."))
        values.append(torch.stack([x.sum(), (x * x).sum()]))
    sharded = any(hasattr(p, "to_local") for p in scorer.parameters())
    if not values:
        total = torch.zeros(0, 2, dtype=torch.float64)
    elif sharded:  # FSDP2 shards add up to the whole tensor
        total = comm.sum_on_host(torch.stack(values))
    else:  # every rank holds the whole model: summing over ranks would count it world_size times
        total = torch.stack(values).cpu()
    return {n: v.tolist() for n, v in zip(names, total)}

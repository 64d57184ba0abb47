"""One rank of the vision-language data-parallel equivalence check (run directly for 1 process, or by
portagrpo.launcher for K).

The policy is the tiny Qwen2.5-VL, sampled by the `hf` engine with its images. So that 1 process and K processes
draw the same responses, each row is generated on its own with a seed made of its prompt tokens, its image
patches and its index among equal rows (the run's per-rank sampling stream would give each rank other draws);
under FSDP2 this still generates through the sharded model, in lockstep, with the images.
Writes `result.pt` from rank 0: the step metrics, the full state dict before and after the steps, and each step's
global batch as the update saw it (row prompts' patches), and whether the vision blocks were sharded units of
their own (resharded before the decoder ran) in the update's forwards.
Usage: vl_worker.py OUT PARALLEL [OVERRIDE ...]
"""
import os
import sys
import zlib
from pathlib import Path

import torch

from portagrpo.config import load_config
from portagrpo.rollout.engines import HFRollout, Sampled

OVERRIDES = [
    "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.tensorboard=false",
    "trainer.plot=false", "model.tiny.vision=true", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
    "model.tiny.num_heads=2", "model.dtype=fp64", "data.train_batch_size=4", "data.max_prompt_length=64",
    "data.max_response_length=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=1",
    "actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-mean", "actor.kl_loss_coef=0.1",
    "actor.entropy_coeff=0.01", "actor.warmup_steps=0", "actor.lr=1e-2", "rollout.engine=hf",
]

_generate = HFRollout.generate


def _row_seed(ids: torch.Tensor, mask: torch.Tensor, images) -> int:
    key = zlib.crc32(bytes(str(ids[mask.bool()].tolist()), "utf8"))
    if images is not None:
        key = zlib.crc32(images.per_row()[0].double().cpu().numpy().tobytes(), key)
    return key


def row_seeded_generate(self, prompt_ids, prompt_mask, params, images=None) -> Sampled:
    """`HFRollout.generate`, one row at a time, each from its own seed (independent of rank and batch)."""
    parts, seen = [], {}
    for i in range(prompt_ids.shape[0]):
        one = None if images is None else images.select([i])
        if one is not None and not one.grids_per_row().numel():  # a row whose prompt has no image
            one = None
        key = _row_seed(prompt_ids[i], prompt_mask[i], one)
        seen[key] = seen.get(key, 0) + 1
        torch.manual_seed(key * 31 + seen[key])
        parts.append(_generate(self, prompt_ids[i:i + 1], prompt_mask[i:i + 1], params, images=one))
    return Sampled(*(None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in range(3)))


def watch_vision_shards(policy) -> list[bool]:
    """For every update forward: whether the first vision block's weights are back in their shards (not gathered)
    by the time the first decoder layer runs."""
    from torch.distributed.tensor import DTensor

    body = policy.model
    block, layer = body.visual.blocks[0], body.language_model.layers[0]
    seen: list[bool] = []

    def look(module, args):
        if module.training and torch.is_grad_enabled():
            seen.append(all(isinstance(p, DTensor) for p in block.parameters()))

    layer.register_forward_pre_hook(look)
    return seen


def run(out: Path, parallel: str, extra: list[str]) -> None:
    from portagrpo.train import Trainer
    from portagrpo.train.update import Updater

    HFRollout.generate = row_seeded_generate
    batches = []
    update = Updater.update

    def recording_update(self, batch, step, *args):
        images = batch.rollout.images
        batches.append({"prompt_ids": batch.rollout.prompt_ids.cpu(), "responses": batch.rollout.responses.cpu(),
                        "row_pixels": None if images is None else images.per_row()[0].cpu()})
        return update(self, batch, step, *args)

    Updater.update = recording_update
    cfg = load_config(None, [*OVERRIDES, f"trainer.parallel={parallel}", *extra])
    trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
    models = trainer.models

    def full_state():
        return {k: v.detach().cpu().clone() for k, v in models.strategy.model_state(models.scorer).items()}

    before = full_state()
    sharded = watch_vision_shards(models.policy)
    metrics = [trainer.step().metrics for _ in range(2)]
    after = full_state()
    if trainer.runtime.comm.is_main:
        torch.save({"metrics": metrics, "before": before, "state": after, "batches": batches,
                    "vision_sharded_in_decoder": sharded, "world": trainer.runtime.comm.world_size,
                    "strategy": models.strategy.name}, out / "result.pt")
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])

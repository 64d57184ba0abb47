"""The loop over steps, written once for the local trainer (`Trainer.fit`, trainer.py) and the Ray driver: validate
before the first step, then step, validate, log and save on the run's cadence, with a progress bar."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from portagrpo.metrics import MetricsLogger, StepReport, ValMetrics


@dataclass(frozen=True)
class Cadence:
    """When to validate and save."""

    total: int
    test_freq: int
    save_freq: int
    val_before_train: bool = True

    def validate_first(self, done: int) -> bool:
        return bool(self.test_freq) and self.val_before_train and done == 0

    def validate_after(self, step: int) -> bool:
        return bool(self.test_freq) and (step % self.test_freq == 0 or step == self.total)

    def save_after(self, step: int) -> bool:
        return bool(self.save_freq) and (step % self.save_freq == 0 or step == self.total)


class Steps(Protocol):
    """What the driver needs of a run: the local Trainer, or the Ray driver's view of its workers."""

    @property
    def step_done(self) -> int: ...

    def advance(self, validate: bool) -> StepReport:
        """One training step (and then validation when asked); its metrics."""

    def validate(self) -> ValMetrics | None: ...

    def save(self) -> Path | str | None: ...


def drive(run: Steps, cadence: Cadence, logger: MetricsLogger | None, *, progress: bool,
          log: Callable[[str], None], desc: str = "grpo",
          on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
    """Train from `run.step_done` to `cadence.total`; the metrics of every step taken."""
    from tqdm.auto import tqdm

    bar = tqdm(total=cadence.total, initial=run.step_done, disable=not progress, dynamic_ncols=True, desc=desc)
    history = []
    try:
        if cadence.validate_first(run.step_done):
            val = run.validate()
            if val is not None:
                log("step 0 validation: " + ", ".join(f"{k}={v:.3f}" for k, v in val.row().items()))
        while run.step_done < cadence.total:
            report = run.advance(cadence.validate_after(run.step_done + 1))
            if logger is not None:
                logger.log(report)
            history.append(report)
            bar.update(1)
            m = report.metrics
            bar.set_postfix(reward=f"{m.reward_mean:.3f}", loss=f"{m.loss_policy:.3f}",
                            tok_s=f"{m.response_tokens_per_s:.0f}")
            if cadence.save_after(run.step_done):
                run.save()
            if on_step is not None:
                on_step(report)
    finally:
        bar.close()
    return history

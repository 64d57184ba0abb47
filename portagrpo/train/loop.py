"""The GRPO training loop, top-down: setup, fit, step. The phases live beside it:
experience.py (rollout -> Experience), update.py (the optimizer steps and metrics), state.py
(checkpoints, RNG, records), build.py (models, data, engine), run_dir.py (the run directory).

The loop orchestrates; the math lives in `portagrpo.algo`, device questions go to the
backend, and every pluggable piece is reached through a registry.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from portagrpo.backends import Backend, get_backend
from portagrpo.backends.dist import Collectives, init_collectives
from portagrpo.config import Config, ConfigError, to_yaml, validate_world
from portagrpo.fileio import write_text_atomic
from portagrpo.kernels import logprob_impl
from portagrpo.metrics import MetricsLogger
from portagrpo.model.parallel import make_strategy
from portagrpo.tolerances import DTYPES
from portagrpo.train.build import Builder
from portagrpo.train.experience import Experience, ExperienceMaker
from portagrpo.train.run_dir import RunDir
from portagrpo.train.state import RunState
from portagrpo.train.update import Updater


@dataclass
class StepOutput:
    metrics: dict[str, Any]
    experience: Experience


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class Cadence:
    """When to validate and save: shared by this loop and the Ray driver."""

    total: int
    test_freq: int
    save_freq: int

    def validate_first(self, done: int) -> bool:
        return bool(self.test_freq) and done == 0

    def validate_after(self, step: int) -> bool:
        return bool(self.test_freq) and (step % self.test_freq == 0 or step == self.total)

    def save_after(self, step: int) -> bool:
        return bool(self.save_freq) and (step % self.save_freq == 0 or step == self.total)


class Trainer(Builder, ExperienceMaker, Updater, RunState):
    def __init__(self, cfg: Config, *, run_dir: str | Path | None = None, resume: str | Path | None = None,
                 log=print, own_outputs: bool = True) -> None:
        """`own_outputs=False` leaves metrics files to a driver (Ray) that collects the metrics."""
        self.cfg = cfg
        self.own_outputs = own_outputs
        self.log = log
        self.run_dir = Path(run_dir or cfg.trainer.output_dir or default_run_dir())
        self.resume_from = resume
        self.step_done = 0

    def setup(self) -> "Trainer":
        cfg = self.cfg
        self.backend: Backend = get_backend(cfg.trainer.device)
        self.comm: Collectives = init_collectives(self.backend, cfg.trainer.dist_timeout_s)
        problems = validate_world(cfg, self.comm.world_size)
        if problems:
            raise ConfigError(problems)
        self._set_threads()
        self.backend.set_deterministic(cfg.trainer.deterministic)
        self.backend.seed(cfg.trainer.seed)
        self.device = self.backend.device(self.comm.env.local_rank)
        self.dtype = DTYPES[cfg.model.dtype]
        if not self.backend.supports_dtype(self.dtype):
            raise ConfigError(
                [f"model.dtype={cfg.model.dtype} is not supported on --device {self.backend.name}; use fp32."]
            )
        # Rank 0 names the run directory (a timestamp would differ between processes).
        self.run_dir = Path(self.comm.broadcast_object(str(self.run_dir)))
        self.run = RunDir(self.run_dir)
        existed = self.run_dir.is_dir()
        before = set(os.listdir(self.run_dir)) if existed else set()
        if self.comm.is_main:
            if self.own_outputs:  # a Ray driver claims the directory itself
                self.run.claim(resuming=self.resume_from is not None, log=self.log)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._setup_parts()
        except BaseException:
            if self.comm.is_main and self.own_outputs and self.resume_from is None:
                self._undo_new_run(existed, before)
            raise
        return self

    def _undo_new_run(self, existed: bool, before: set[str]) -> None:
        """A new run refused during setup leaves the disk as it found it: the directory it created,
        or the entries it added to an empty one (a new run only ever starts in one of those)."""
        self.run.unlock()
        if not existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        for name in set(os.listdir(self.run_dir)) - before:
            entry = self.run_dir / name
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def _setup_parts(self) -> None:
        cfg = self.cfg
        self.strategy = make_strategy(self.backend.parallel_strategy(cfg.trainer.parallel), self.comm)
        self.kernel_name = self.backend.kernel_implementation(cfg.kernels.logprob)
        self.kernel = logprob_impl(self.kernel_name)
        self._setup_data()
        self._setup_models()
        self._setup_optimizer()
        self.engine = self._make_engine()
        resume_step = self._maybe_resume()
        if resume_step:
            self.push_weights_to_engine()  # the engine loaded the initial weights
        self.logger = (MetricsLogger(self.run_dir, tensorboard=cfg.trainer.tensorboard, resume_step=resume_step,
                                     warn=self.log)
                       if self.comm.is_main and self.own_outputs else None)
        if self.comm.is_main:  # last: a resume refused anywhere above leaves the run's config.yaml as it was
            write_text_atomic(self.run.config, to_yaml(cfg), what="writing")

    def fit(self, progress: bool | None = None) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        t, when = self.cfg.trainer, self.cadence
        show = (t.progress_bar if progress is None else progress) and self.comm.is_main
        bar = tqdm(total=self.total_steps, initial=self.step_done, disable=not show, dynamic_ncols=True, desc="grpo")
        history = []
        try:
            if when.validate_first(self.step_done):
                self._log_val_only()
            while self.step_done < self.total_steps:
                metrics = self.step().metrics
                if when.validate_after(self.step_done):
                    metrics.update(self.validate())
                if self.logger is not None:
                    self.logger.log(metrics)
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss_policy']:.3f}",
                                tok_s=f"{metrics['response_tokens_per_s']:.0f}")
                if when.save_after(self.step_done):
                    self.save()
        finally:
            bar.close()
        return history

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.total_steps, self.cfg.trainer.test_freq, self.cfg.trainer.save_freq)

    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        self.backend.reset_peak_memory()
        exp = self.make_experience(self.step_done + 1)
        out = StepOutput(self.train_on(exp, t0), exp)
        if self.cfg.trainer.record_rollouts:
            self.record(out)
        return out

    def _log_val_only(self) -> None:
        val = self.validate()
        if val and self.comm.is_main:
            self.log("step 0 validation: " + ", ".join(f"{k}={v:.3f}" for k, v in val.items()))

    def close(self) -> None:
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
        if getattr(self, "logger", None) is not None:
            if self.cfg.trainer.plot:
                self.logger.plot()
            self.logger.close()
        if getattr(self, "comm", None) is not None:
            self.comm.close()
        if getattr(self, "run", None) is not None:
            self.run.unlock()

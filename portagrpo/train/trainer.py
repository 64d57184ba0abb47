"""The Trainer: one process's share of a run, top-down: setup, fit, step. One step's route:

    scored  = schedule.next(step)                          schedule.py    (when: in the step, or one step ahead)
                                                           pipeline.py    (prompts, generator, rewards, filter,
                                                                           log-probs: the one rollout pipeline)
    exp     = experience.prepare(scored)                   experience.py  (rollout correction, advantages)
    stats   = updater.update(exp.batch, step)              update.py      (mini/micro-batches, optimizer, schedule)
    push_weights(engine, models); schedule.push(models)    build.py       (engines with their own weights)
    metrics = step_metrics(step, exp, stats, times, rt)    report.py

`build.py` makes the parts from the config, `checkpointer.py` saves and resumes them, `record.py` keeps a
step for replay, `loop.py` is the loop over steps that the Ray driver shares, and `run_dir.py` owns
the run directory. The loop alone counts steps; the math lives in `portagrpo.algo`, device
questions go to the backend, and every pluggable piece is reached through a registry.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from portagrpo.config import Config, to_dict, to_yaml
from portagrpo.fileio import write_text_atomic
from portagrpo.metrics import MetricsLogger, StepReport, ValMetrics, make_trackers
from portagrpo.rollout.generators import Generator, GeneratorInputs, generator_spec, make_generator
from portagrpo.train.build import Models, Parts, Runtime, build, make_runtime, push_weights
from portagrpo.train.checkpointer import Checkpointer
from portagrpo.train.experience import Experience, ExperienceMaker, ExperienceSettings
from portagrpo.train.logprobs import ScoringSettings
from portagrpo.train.loop import Cadence, drive
from portagrpo.train.pipeline import Pipeline, RolloutSettings
from portagrpo.train.record import StepRecord, param_fingerprint, record_of
from portagrpo.train.report import StepTimes, step_metrics
from portagrpo.train.run_dir import RunDir
from portagrpo.train.schedule import Schedule, ScheduleInputs, schedule_of
from portagrpo.train.update import Updater, UpdateSettings


@dataclass
class StepOutput:
    metrics: StepReport  # typed; a logger flattens it (read-only key access gives the logged row)
    experience: Experience


def default_run_dir(project: str | None = None, experiment: str | None = None) -> Path:
    """runs/<project>/<experiment> (verl's names) when given, else runs/<timestamp>."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if project or experiment:
        return Path("runs") / (project or "portagrpo") / (experiment or stamp)
    return Path("runs") / stamp


class Trainer:
    """One process's share of a run. `setup()` builds the parts; `fit()` trains to the end."""

    def __init__(self, cfg: Config, *, run_dir: str | Path | None = None, resume: str | Path | None = None,
                 log=print, own_outputs: bool = True) -> None:
        """`own_outputs=False` leaves metrics files to a driver (Ray) that collects the metrics."""
        self.cfg = cfg
        self.own_outputs = own_outputs
        self.log = log
        t = cfg.trainer
        self.run_dir = Path(run_dir or t.output_dir or default_run_dir(t.project_name, t.experiment_name))
        self.resume_from = resume
        self.step_done = 0
        self.runtime: Runtime | None = None
        self.parts: Parts | None = None
        self.logger: MetricsLogger | None = None
        self.run: RunDir | None = None
        self.pipeline: Pipeline | None = None
        self.experience: ExperienceMaker | None = None
        self.schedule: Schedule | None = None
        self.generator: Generator | None = None
        self.kind = schedule_of(cfg.rollout.mode)  # the schedule's class: what it declares, before it is built

    def setup(self) -> "Trainer":
        self.runtime = make_runtime(self.cfg, processes=2 if self.kind.apart else 1)
        comm = self.runtime.comm
        # Rank 0 names the run directory (a timestamp would differ between processes).
        self.run_dir = Path(comm.broadcast_object(str(self.run_dir)))
        self.run = RunDir(self.run_dir)
        existed = self.run_dir.is_dir()
        before = set(os.listdir(self.run_dir)) if existed else set()
        if comm.is_main:
            if self.own_outputs:  # a Ray driver claims the directory itself
                self.run.claim(resuming=self.resume_from is not None, log=self.log)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            with self.runtime.phase("load"):  # models, engine, data: logged with the first step's metrics
                self._setup_parts()
        except BaseException:
            self._close_parts()  # the reward pool, a sampler process and the tools end with the refused setup
            if comm.is_main and self.own_outputs and self.resume_from is None:
                self._undo_new_run(existed, before)
            raise
        return self

    def _close_parts(self) -> None:
        if self.generator is not None:
            self.generator.close()
        if self.parts is not None:
            self.parts.close()

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
        cfg, rt = self.cfg, self.runtime
        self.parts = p = build(cfg, rt, self.run_dir, self.log, apart=self.kind.apart)
        settings = ExperienceSettings.from_config(cfg, stale=self.kind.stale)
        self.generator = make_generator(generator_spec(cfg), GeneratorInputs(
            p.data.tokenizer, p.data.processor, rank=rt.comm.rank, local_world_size=rt.comm.env.local_world_size,
            lockstep=rt.comm, log=self.log))
        self.pipeline = Pipeline(RolloutSettings.from_config(cfg),
                                 ScoringSettings.from_config(cfg, rt.comm.world_size, settings.scoring_pass), rt,
                                 p.data, p.models, p.engine, self.generator, self.log)
        self.experience = ExperienceMaker(settings, p.shaping)
        self.schedule = self.kind(ScheduleInputs(self.pipeline, p.data.loader, p.sampler, p.total_steps, self.log))
        self.updater = Updater(UpdateSettings.from_config(cfg, rt.comm.world_size, not settings.scoring_pass,
                                                          settings.corrects_in_update),
                               rt, p.models, p.optim, p.objective, self.log)
        saved_with = p.data.tokenizer if p.data.processor is None else p.data.processor  # a VL model's processor
        self.checkpoints = Checkpointer(self.run_dir, rt, p.models, p.optim, p.data.loader, saved_with,
                                        keep=cfg.trainer.max_ckpt_to_keep, lora_rank=cfg.model.lora.rank, log=self.log)
        if self.resume_from is not None:
            resumed = self.checkpoints.resume(self.resume_from)
            self.step_done = resumed.step
            push_weights(p.engine, p.models)  # the engine loaded the initial weights
            self.schedule.push(p.models)
            self.schedule.restore(resumed.inflight, self.step_done)
        elif p.engine.needs_weights:  # an engine built without real weights (vLLM: dummy ones)
            push_weights(p.engine, p.models)
        if rt.comm.is_main and self.own_outputs:
            t = cfg.trainer
            trackers = make_trackers(t.logger, self.run_dir, project=t.project_name, experiment=t.experiment_name,
                                     config=to_dict(cfg))
            self.logger = MetricsLogger(self.run_dir, tensorboard=cfg.tensorboard, resume_step=self.step_done,
                                        warn=self.log, trackers=trackers)
        if rt.comm.is_main:  # last: a resume refused anywhere above leaves the run's config.yaml as it was
            write_text_atomic(self.run.config, to_yaml(cfg), what="writing")

    @property
    def models(self) -> Models:
        return self.parts.models

    @property
    def total_steps(self) -> int:
        return self.parts.total_steps

    @property
    def cadence(self) -> Cadence:
        t = self.cfg.trainer
        return Cadence(self.total_steps, t.test_freq, t.save_freq, t.val_before_train)

    def fit(self, progress: bool | None = None) -> list[StepReport]:
        main = self.runtime.comm.is_main
        show = (self.cfg.progress_bar if progress is None else progress) and main
        return drive(self, self.cadence, self.logger, progress=show, log=self.log if main else (lambda m: None))

    def advance(self, validate: bool) -> StepReport:
        report = self.step().metrics
        return report.with_val(self.validate()) if validate else report

    def step(self) -> StepOutput:
        """Sample, score and update on the next prompt batch."""
        start = time.perf_counter()
        self.runtime.memory.start_step()
        step = self.step_done + 1
        out = self._update(step, self.experience.prepare(self.schedule.next(step)), start)
        if self.cfg.trainer.record_rollouts:
            self.record(out)
        return out

    def replay(self, record: StepRecord) -> StepOutput:
        """Update on a recorded step's rollout instead of sampling one (`portagrpo replay`)."""
        start = time.perf_counter()
        return self._update(self.step_done + 1, self.experience.prepare(self.pipeline.from_record(record)), start)

    def _update(self, step: int, exp: Experience, start: float) -> StepOutput:
        t_update = time.perf_counter()
        stats = self.updater.update(exp.batch, step, exp.old_routes)
        with self.runtime.phase("push weights"):
            push_weights(self.parts.engine, self.parts.models)
            self.schedule.push(self.parts.models)
        self.runtime.backend.synchronize()
        times = StepTimes(start, exp.t_gen, exp.t_scored, t_update, time.perf_counter())
        self.step_done = step
        return StepOutput(StepReport(step_metrics(step, exp, stats, times, self.runtime)), exp)

    def validate(self) -> ValMetrics | None:
        return self.pipeline.validate(self.step_done, self.parts.data.val_records)

    def save(self) -> Path | None:
        with self.runtime.phase("checkpoint"):  # its peak is logged with the next step's metrics
            return self.checkpoints.save(self.step_done, self.schedule.state())

    def fingerprint(self) -> dict[str, list[float]]:
        return param_fingerprint(self.models.scorer, self.runtime.comm)

    def record(self, out: StepOutput) -> None:
        """Keep this step's rollout, metrics and parameter fingerprint for replay (rank 0 writes)."""
        fingerprint = self.fingerprint()
        if self.runtime.comm.is_main:
            setting = {"device": self.runtime.backend.name, "dtype": self.cfg.model.dtype,
                       "kernel": self.models.kernel_name}
            exp = out.experience
            record_of(exp.batch.rollout, exp.raw_scores, exp.correct, out.metrics.row(), fingerprint,
                      setting).save(self.run_dir / "rollouts")

    def close(self, failed: bool = False) -> None:
        """`failed`: this rank is ending on an error, so it leaves the process group without waiting for
        its peers (backends/dist.py: `Collectives.close(abandon=True)`); they fail fast instead of hanging."""
        self._close_parts()
        if self.logger is not None:
            if self.cfg.trainer.plot:
                self.logger.plot()
            self.logger.close()
        if self.runtime is not None:
            self.runtime.comm.close(abandon=failed)
        if self.run is not None:
            self.run.unlock()

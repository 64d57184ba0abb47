"""Run outputs: metrics.jsonl, TensorBoard scalars, and the reward/KL plot."""
from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from portagrpo.fileio import WriteError, describe_os_error, write_text_atomic


def _measured(doc: str = ""):
    """A metric taken from the clock or the allocator: two runs with identical numbers still differ in it."""
    return field(metadata={"measured": True, "doc": doc})


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """Every metric a training step logs (`metrics.jsonl`, TensorBoard, the Ray driver), in log order.
    `portagrpo.train.report.step_metrics` fills it; a None field (no reference model, no KL loss)
    is left out of the log rather than written as a made-up 0."""

    step: int
    reward_mean: float
    reward_std: float
    acc: float
    score_mean: float  # after reward shaping
    adv_mean: float
    adv_std: float
    loss_policy: float
    loss_kl: float | None = None  # with a KL loss
    kl: float | None = None  # with a reference model
    entropy: float
    clipfrac: float
    clipfrac_lower: float
    ppo_kl: float
    ratio_mean: float
    grad_norm: float
    response_len_mean: float
    prompt_len_mean: float
    response_clip_ratio: float  # share of responses that hit data.max_response_length (verl's clip_ratio)
    zero_std_group_frac: float
    reward_errors: float
    gen_rounds: int  # sampling rounds of the step (more than 1 only with DAPO's dynamic sampling)
    rollout_staleness: int | None = None  # rollout.mode=one_step_off: updates the sampler's weights lag behind
    lr: float
    time_step_s: float = _measured()
    time_gen_s: float = _measured()
    time_prep_s: float = _measured("reward + log-probs + gather + advantages")
    time_reward_s: float = _measured()
    time_logprob_s: float = _measured("log-probs, gather and advantages")
    time_update_s: float = _measured()
    response_tokens_per_s: float = _measured("response tokens of all ranks per second of step time")
    tokens_per_s_per_device: float = _measured("verl's perf/throughput: all tokens / (step time x devices)")
    mem_peak_gb: float = _measured()
    world_size: int
    # `rollout_corr/*`: the sampler against the trainer (algo/rollout_correction.py), when the engine
    # reports the log-probs it sampled with; logged flat beside the rest
    rollout_corr: dict[str, float] | None = None
    # a batch source's own metrics, logged flat (multi-turn: `tool/calls`, `tool/errors`, `tool/timeouts`,
    # `turns_mean`); None for the other sources
    rollout_metrics: dict[str, float] | None = None
    # `mem/<phase>_peak_gb`: each phase's own peak since the last step's report, the largest over the ranks
    # (train/memory.py; load with the first step, a checkpoint with the step after it); logged flat
    memory: dict[str, float] | None = None
    # `moe/route_agreement`: a mixture-of-experts policy's share of (token, layer) top-k decisions in the step's
    # forwards that chose the experts the batch's routes hold (the sampler's; model/router_replay.py); logged flat
    moe: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        flat = ("rollout_corr", "rollout_metrics", "memory", "moe")
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
               and f.name not in flat}
        return {**out, **(self.rollout_corr or {}), **(self.rollout_metrics or {}), **(self.memory or {}),
                **(self.moe or {})}


class _RowView(Mapping):
    """Read-only access to the row a logger writes (`row()`), by its keys: what callers of `Trainer.fit()` and
    `Trainer.step()` have always indexed. The typed fields stay the object's content."""

    def row(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.row()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.row())

    def __len__(self) -> int:
        return len(self.row())


@dataclass(frozen=True, eq=False)
class ValMetrics(_RowView):
    """Held-out validation after a step (`Pipeline.validate`), logged as `val/*`."""

    reward_mean: float
    acc: float
    k: int = 1  # rollout.val_n: samples per prompt
    pass_at_k: float | None = None  # share of prompts with a correct sample among k (k > 1)

    def row(self) -> dict[str, float]:
        out = {"val/reward_mean": self.reward_mean, "val/acc": self.acc}
        if self.pass_at_k is not None:
            out[f"val/pass@{self.k}"] = self.pass_at_k
        return out


@dataclass(frozen=True, eq=False)
class StepReport(_RowView):
    """One step as it reaches the loggers and the Ray driver: its metrics and the validation that followed it,
    typed. Only a logger flattens it, into the row that metrics.jsonl holds (`row()`)."""

    metrics: StepMetrics
    val: ValMetrics | None = None

    @property
    def step(self) -> int:
        return self.metrics.step

    def with_val(self, val: ValMetrics | None) -> "StepReport":
        return replace(self, val=val)

    def row(self) -> dict[str, Any]:
        return {**self.metrics.as_dict(), **(self.val.row() if self.val is not None else {})}


# Keys every step's row has (derived: the fields that are never None).
REQUIRED_KEYS = tuple(f.name for f in fields(StepMetrics) if f.default is not None)

# Measured by the clock or the allocator: two runs with identical numbers still differ in these.
class _MeasuredKeys(frozenset):
    """The measured fields, and every `mem/<phase>_peak_gb` (logged flat from StepMetrics.memory)."""

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and key.startswith("mem/"))


MEASURED_KEYS = _MeasuredKeys(f.name for f in fields(StepMetrics) if f.metadata.get("measured"))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def read_metrics(path: Path, warn=None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. A torn last line (the process was killed mid-write) is dropped
    with a notice through `warn`; a damaged line anywhere else is an error naming it."""
    from portagrpo.errors import UserError

    path = Path(path)
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise UserError(f"{path} line {n} is not JSON ({line[:40]!r}); repair or remove that line.") from None
            if warn is not None:
                warn(f"ignoring a torn last line of {path} (line {n}, written when the run was killed)")
    return rows


class WandbTracker:
    """`trainer.logger` with `wandb`: every step's metrics to a W&B run named after trainer.project_name and
    trainer.experiment_name, with the config as the run's config. The run's id is kept in the run directory,
    so a resumed run continues the same W&B run. WANDB_MODE=offline keeps it in <run>/wandb."""

    def __init__(self, run_dir: Path, project: str | None, name: str | None, config: dict[str, Any]) -> None:
        import wandb

        id_file = Path(run_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        write_text_atomic(id_file, run_id + "\n", what="writing")
        self.run = wandb.init(project=project or "portagrpo", name=name or Path(run_dir).name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config)

    def log(self, report: StepReport) -> None:
        numbers = {k: v for k, v in report.row().items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        self.run.log(numbers, step=report.step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """`trainer.logger` with `mlflow`: every step's metrics to an MLflow run (experiment trainer.project_name,
    run trainer.experiment_name), the flattened config as its parameters; a resumed run continues the same
    MLflow run. The tracking store is MLFLOW_TRACKING_URI, else a local file store in <run>/mlruns."""

    def __init__(self, run_dir: Path, project: str | None, name: str | None, config: dict[str, Any]) -> None:
        import os

        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir) / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        id_file = Path(run_dir) / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            return
        project = project or "portagrpo"
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name or Path(run_dir).name).info.run_id
        write_text_atomic(id_file, self.run_id + "\n", what="writing")
        from mlflow.entities import Param

        flat = _flatten(config)
        params = [Param(k, str(v)[:500]) for k, v in flat.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, report: StepReport) -> None:
        import time

        from mlflow.entities import Metric

        stamp, step = int(time.time() * 1000), report.step
        batch = [Metric(mlflow_key(k), float(v), stamp, step) for k, v in report.row().items()
                 if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """MLflow names take letters, digits, _ - . / and spaces: `val/pass@4` becomes `val/pass_at_4`."""
    return key.replace("@", "_at_")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(_flatten(value, path + ".") if isinstance(value, dict) else {path: value})
    return out


def make_trackers(names: list[str], run_dir: Path, *, project: str | None, experiment: str | None,
                  config: dict[str, Any]) -> list[Any]:
    """The external trackers `trainer.logger` names (console and tensorboard are MetricsLogger's own)."""
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[n](run_dir, project, experiment, config) for n in names if n in kinds]


class MetricsLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool, resume_step: int = 0, warn=print,
                 trackers: list[Any] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.trackers = list(trackers)
        self.path = self.run_dir / "metrics.jsonl"
        # A resumed run drops rows written after its checkpoint, so every step appears once; the
        # rewrite is atomic, so a kill here cannot lose the rows before the checkpoint.
        rows = [r for r in read_metrics(self.path, warn) if r.get("step", 0) <= resume_step] if resume_step else []
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows), what="writing")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1)
            except ImportError:  # tensorboard is a core dependency, but keep training without it
                self.writer = None

    def log(self, report: StepReport) -> None:
        """One step, flattened here into its row for each sink (jsonl, TensorBoard, the trackers)."""
        metrics = report.row()
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        try:  # a line torn by a full disk is dropped on resume, like one torn by a kill
            with self.path.open("a") as fh:
                fh.write(json.dumps(clean) + "\n")
        except OSError as err:
            raise WriteError(describe_os_error(err, self.path, "appending to")) from None
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, report.step)
        for tracker in self.trackers:
            tracker.log(report)

    def plot(self) -> Path | None:
        return plot_reward(self.path, self.run_dir / "reward.png")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.close()


def plot_reward(metrics_path: Path, out: Path) -> Path | None:
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward_mean", color="tab:blue")
    val = [(r["step"], r["val/reward_mean"]) for r in rows if r.get("val/reward_mean") is not None]
    if val:
        ax.plot(*zip(*val), "o--", label="val/reward_mean", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    lines = ax.get_legend_handles_labels()[0]
    if any(r.get("kl") is not None for r in rows):  # runs without a reference model log no kl
        ax2 = ax.twinx()
        ax2.plot(steps, [r["kl"] if r.get("kl") is not None else float("nan") for r in rows], label="kl",
                 color="tab:red", alpha=0.6)
        ax2.set_ylabel("kl")
        lines += ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left")
    ax.set_title("portagrpo: reward and KL per step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

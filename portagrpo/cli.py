"""Command line: `portagrpo train|doctor ...`."""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from portagrpo.errors import UserError


def _fail(err: BaseException) -> int:
    """One sentence for the user. A rank of a multi-rank run names itself, and under portagrpo's own launcher
    leaves the sentence to the launcher, which prints the first failing rank's cause once for the run."""
    from portagrpo.backends.dist import PeerFailure
    from portagrpo.procs import rank_prefix, report_rank_failure

    text, prefix = str(err), rank_prefix()
    if prefix:
        text = text.removeprefix(prefix)
        if report_rank_failure(" ".join(text.split()), peer=isinstance(err, PeerFailure)):
            return 2
        text = prefix + text
    for line in text.splitlines():
        print(f"portagrpo: error: {line}", file=sys.stderr)
    return 2


def _train_parser(sub, help: str) -> None:
    p = sub.add_parser("train", help=help)
    p.add_argument("--config", help="YAML recipe (see configs/); defaults are the tiny CPU demo")
    p.add_argument("--device", help="cpu|cuda|rocm|npu|auto (same as trainer.device=...)")
    p.add_argument("--output-dir", help="run directory (default runs/<timestamp>)")
    p.add_argument(
        "--resume", help="run directory, checkpoint directory, or 'auto' (the --output-dir or the newest run)"
    )
    p.add_argument("--print-config", action="store_true", help="print the merged config and exit")
    p.add_argument("--dry-run", action="store_true", help="resolve and validate everything, then exit without training")
    p.add_argument(
        "--ray", action="store_true", help="place training workers with Ray (trainer.nnodes x trainer.devices_per_node)"
    )
    p.add_argument("--ray-address", default=None, help="address of a running Ray cluster (default: start a local one)")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted keys, e.g. actor.lr=1e-3")


def _dry_run(config_path, overrides: list[str]) -> int:
    """Resolve and check everything a run needs without a device: types, choices, batch divisions
    for the configured world size, names in every registry, the reward function. Files this
    machine lacks (models, datasets) are listed, not errors: a recipe is usually checked
    away from the cluster that holds them."""
    from portagrpo.backends import get_backend
    from portagrpo.config import ConfigError, load_config, missing_files, strategy_problems, validate_world
    from portagrpo.plan.gate import strategy_of
    from portagrpo.rewards.functions import RewardResolver
    from portagrpo.rollout.generators import generator_problem

    notices: list[str] = []
    cfg = load_config(config_path, overrides, check_files=False, notices=notices)
    for line in notices:
        print(f"portagrpo: {line}")
    t = cfg.trainer
    world = t.nnodes * t.devices_per_node if t.nnodes > 1 else t.nproc_per_node
    problems = validate_world(cfg, world)
    if not problems:
        problems = strategy_problems(cfg, world, strategy_of(cfg, world, _dry_run_device(t.device)))
    generator = generator_problem(cfg, _vision_policy(cfg))
    problems += [generator] if generator else []
    if ":" not in cfg.reward.function:
        try:
            RewardResolver(cfg.reward.function)
        except UserError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(problems)
    try:
        backend = get_backend(t.device)
        device = f"{backend.name} (usable here)"
        backend.rollout_engine(cfg.rollout.engine)
    except UserError as err:
        device = f"{t.device}: not usable on this machine ({err})"
    print(f"config OK: {config_path or 'built-in defaults'}; {world} rank(s); device {device}")
    if cfg.rollout.multi_turn.enable:
        from portagrpo.agent.isolation import probe
        from portagrpo.agent.tools import tool_workers_problem

        print(f"  on this machine, {probe().describe()}")
        too_many = tool_workers_problem(cfg.rollout.multi_turn.tool_workers, t.nproc_per_node)
        if too_many:
            print(f"  on this machine, a run would stop: {too_many}")
    for missing in missing_files(cfg):
        print(f"  to provide before training: {missing}")
    _check_sequence_parallel_heads(cfg)
    if t.device_memory_gb is not None:  # the cluster the recipe is planned for: its memory plan (portagrpo plan)
        from portagrpo.plan.gate import plan_config, refusal
        from portagrpo.tools.plan import describe

        memory, source = plan_config(cfg)
        for line in describe(memory, source):
            print(f"  {line}")
        problem = refusal(memory)
        if problem:
            raise UserError(problem)
    return 0


def _vision_policy(cfg) -> bool | None:
    """Whether the policy is a vision-language one, where this machine can tell (the tiny one, or a model.path it
    holds); None for a model directory elsewhere (a recipe checked away from its cluster)."""
    from pathlib import Path

    from portagrpo.paths import uses_vision

    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        return None
    return uses_vision(cfg.model)


def _dry_run_device(device: str) -> str | None:
    """The device kind a run of `device` would take on this machine (auto: what is here), None where unknown."""
    from portagrpo.backends import get_backend

    try:
        return get_backend(device).name
    except UserError:
        return None if device == "auto" else device


def _launch_ranks(cfg, argv: list[str]) -> int:
    """`trainer.nproc_per_node=K`: this command again as K local ranks (portagrpo.launcher), after the
    batch divisions are checked once here instead of once per rank."""
    from portagrpo.config import ConfigError, validate_world
    from portagrpo.launcher import launch_local
    from portagrpo.procs import portagrpo_command

    problems = validate_world(cfg, cfg.trainer.nproc_per_node)
    if problems:
        raise ConfigError(problems)
    return launch_local(cfg.trainer.nproc_per_node, portagrpo_command(*argv))


def _resume_from_config(cfg, output_dir):
    """trainer.resume_mode (verl's): auto continues the output directory's latest whole checkpoint if it
    has one (else a new run); resume_path continues trainer.resume_from_path."""
    from portagrpo.errors import UserError
    from portagrpo.train.run_dir import resolve_run

    t = cfg.trainer
    out = output_dir or t.output_dir
    if t.resume_mode == "resume_path":
        if not t.resume_from_path:
            raise UserError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a run directory or "
                            "a checkpoint); set it, or use trainer.resume_mode=auto.")
        return resolve_run(out, t.resume_from_path)
    if not out:
        return None, None  # auto with a new default directory: nothing to continue
    return resolve_run(out, "auto")


def cmd_train(args) -> int:
    from portagrpo.config import load_config, to_yaml

    overrides = list(args.overrides)
    if args.device:
        overrides.append(f"trainer.device={args.device}")
    from portagrpo.train.run_dir import resolve_run

    run_dir, resume = resolve_run(args.output_dir, args.resume)
    config_path = args.config
    if resume is not None and config_path is None and (run_dir / "config.yaml").is_file():
        config_path = run_dir / "config.yaml"
    notices: list[str] = []
    if args.dry_run:
        return _dry_run(config_path, overrides)
    cfg = load_config(config_path, overrides, notices=notices)
    if args.resume is None and cfg.trainer.resume_mode != "disable":
        run_dir, resume = _resume_from_config(cfg, args.output_dir)
    if os.environ.get("RANK", "0") == "0":
        for line in notices:
            print(f"portagrpo: {line}")
    if cfg.trainer.device_memory_gb is not None and "WORLD_SIZE" not in os.environ and not args.print_config:
        _refuse_unfitting_plan(cfg)  # once, before any rank starts
    if cfg.trainer.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ and not args.print_config:
        return _launch_ranks(cfg, args.argv)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    if args.ray or args.ray_address:
        from portagrpo.ray_launcher import train_with_ray
        from portagrpo.train import default_run_dir

        t = cfg.trainer
        history = train_with_ray(cfg, run_dir or Path(t.output_dir or default_run_dir(t.project_name,
                                                                                      t.experiment_name)),
                                 str(resume) if resume else None, args.ray_address)
        _summary(history, run_dir)
        return 0
    from portagrpo.procs import LAUNCHER_ENV, exit_with_parent
    from portagrpo.train import Trainer

    main_rank = os.environ.get("RANK", "0") == "0"
    if os.environ.get(LAUNCHER_ENV):
        exit_with_parent(int(os.environ[LAUNCHER_ENV]), f"rank {os.environ.get('RANK', '?')}")
    trainer = Trainer(cfg, run_dir=run_dir, resume=resume, log=print if main_rank else (lambda message: None))
    start = time.time()
    try:  # close (lock, reward workers, process group) however setup or training ends
        history = _setup_and_fit(trainer, main_rank)
    except BaseException:
        trainer.close(failed=True)  # a failing rank leaves the group at once: no peer waits for it
        raise
    trainer.close()
    if main_rank:
        _summary(history, trainer.run_dir, time.time() - start)
    return 0


def _check_sequence_parallel_heads(cfg) -> None:
    """actor.ulysses_sequence_parallel_size against the model's heads, read from its config.json (or the shape of the
    model of that name portagrpo ships) before a run: the same sentence the run would stop with."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp <= 1:
        return
    from portagrpo.model.ulysses import check_heads
    from portagrpo.plan.shapes import model_shape

    try:
        shape = model_shape(cfg)[0]
    except UserError:  # no config.json here and no shipped shape: the run checks it once the model is there
        return
    problem = check_heads(shape.heads, shape.kv_heads, sp)
    if problem:
        raise UserError(problem)


def _refuse_unfitting_plan(cfg) -> None:
    """A run stated for a cluster (trainer.device_memory_gb) whose memory plan does not fit stops here, in one
    sentence, instead of running out of memory on its devices."""
    from portagrpo.plan.gate import plan_config, refusal

    problem = refusal(plan_config(cfg)[0])
    if problem:
        raise UserError(problem)


def _setup_and_fit(trainer, main_rank: bool) -> list[dict]:
    trainer.setup()
    if main_rank:
        print(f"run directory: {trainer.run_dir} (device {trainer.runtime.backend.name}, "
              f"{trainer.runtime.comm.world_size} "
              f"process(es), {trainer.models.strategy.name} parallel, {trainer.total_steps} steps)")
    if main_rank and trainer.step_done >= trainer.total_steps:
        print(f"nothing to do: the run is at step {trainer.step_done} of {trainer.total_steps}; raise "
              f"trainer.total_steps (or total_epochs) to train further.")
    return trainer.fit()


def _summary(history: list, run_dir, seconds: float | None = None) -> None:
    """`history`: the run's StepReports."""
    if not history:
        return
    k = max(1, len(history) // 10)
    first = sum(r.metrics.reward_mean for r in history[:k]) / k
    last = sum(r.metrics.reward_mean for r in history[-k:]) / k
    took = f" in {seconds:.0f}s" if seconds is not None else ""
    print(f"done{took}: reward first 10% {first:.3f} -> last 10% {last:.3f}; outputs in {run_dir}")


def cmd_doctor(args) -> int:
    from portagrpo.tools.doctor import collect, render

    info = collect()
    print(json.dumps(info, indent=1, default=str) if args.json else render(info))
    if args.require:
        row = next((r for r in info["backends"] if r["backend"] == args.require), None)
        if row is None or not row["available"]:
            reason = row["reason"] if row else "it is not a known backend"
            print(f"portagrpo: error: --require {args.require}: {reason}", file=sys.stderr)
            return 1
    return 0


def _tool(module: str, drop: int = 0):
    """A sub-command whose module parses its own arguments (`main_cli(argv)`), imported when run."""
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main_cli(argv[drop:])
    return run


BENCHMARKS = {"kernels": "portagrpo.tools.bench", "step": "portagrpo.tools.bench_step"}


def cmd_plan(args) -> int:
    from portagrpo.tools.plan import cmd_plan as run

    return run(args)


def cmd_bench(argv: list[str]) -> int:
    usage = (
        "usage: portagrpo bench kernels|step ...\n  step     the whole GRPO step by phase against its FLOP floor "
        "(`portagrpo bench step --help`)\n  kernels  log-prob kernel time and memory (`portagrpo bench kernels --help`)"
    )
    if argv[:1] in (["--help"], ["-h"]):
        print(usage)
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(usage, file=sys.stderr)
        return 2
    return _tool(BENCHMARKS[argv[0]], drop=1)(argv)


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable  # (argparse args) for "parsed" commands, (argv) for the others
    parsed: bool = False  # arguments parsed here (train, doctor) or by the tool itself


# The one command table: `portagrpo <name> ...`.
COMMANDS: dict[str, Command] = {
    "train": Command("train a policy with GRPO/DrGRPO", cmd_train, parsed=True),
    "doctor": Command("what this machine has, per backend", cmd_doctor, parsed=True),
    "plan": Command("the memory plan of a run: each device's peak per phase, and whether it fits", cmd_plan,
                    parsed=True),
    "parity": Command(
        "compare this backend with the float64 golden (`portagrpo parity --help`)", _tool("portagrpo.tools.parity")
    ),
    "bench": Command("benchmarks: `bench step` (the whole GRPO step by phase), `bench kernels`", cmd_bench),
    "replay": Command(
        "re-train a recorded run on another backend (`portagrpo replay --help`)", _tool("portagrpo.tools.replay")
    ),
    "data": Command(
        "convert GSM8K / MATH / geo3k files to the training schema (`portagrpo data --help`)",
        _tool("portagrpo.data.prepare"),
    ),
    "eval": Command(
        "greedy accuracy and pass@k of a model or run (`portagrpo eval --help`)", _tool("portagrpo.tools.evaluate")
    ),
    "export": Command(
        "write the trained policy as a Hugging Face model (`portagrpo export --help`)", _tool("portagrpo.tools.export")
    ),
    "warmstart": Command(
        "a tiny policy that knows the Hermes tool-call format, for configs/calc-tool-cpu.yaml (`portagrpo warmstart "
        "--help`)", _tool("portagrpo.tools.warmstart"),
    ),
    "hardware-check": Command(
        "the whole check of this machine's device, one report (`portagrpo hardware-check --help`)",
        _tool("portagrpo.tools.hardware_check"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portagrpo", description="GRPO/DrGRPO trainer with the same numbers on every backend"
    )
    sub = parser.add_subparsers(dest="command")
    for name, command in COMMANDS.items():
        if name == "train":
            _train_parser(sub, command.help)
        elif name == "doctor":
            d = sub.add_parser("doctor", help=command.help)
            d.add_argument("--json", action="store_true")
            d.add_argument(
                "--require", metavar="BACKEND", help="exit 1 unless this backend is usable (image health checks)"
            )
        elif name == "plan":
            from portagrpo.tools.plan import add_parser

            add_parser(sub)
        else:
            sub.add_parser(name, help=command.help)
    return parser


def main(argv: list[str] | None = None) -> int:
    from portagrpo.backends.npu_env import guard_torch_import

    guard_torch_import()  # must run before torch is imported (see backends/npu_env.py)
    from portagrpo.model.loading import quiet_transformers

    quiet_transformers()
    from portagrpo.procs import Stopped, stop_on_sigterm

    previous = stop_on_sigterm()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(parser, argv)
    except Exception as err:  # a bug, not the user's error: its traceback, and on a rank the rank's sentence
        from portagrpo.procs import rank_prefix, report_rank_failure

        if not rank_prefix():
            raise
        traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        sentence = f"{type(err).__name__}: {first} (its traceback is printed above)"
        if not report_rank_failure(sentence, peer=False):
            print(f"portagrpo: error: {rank_prefix()}{sentence}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as err:
        what = "Ctrl-C" if isinstance(err, KeyboardInterrupt) else "SIGTERM"
        if _speaks_for_the_run():
            print(f"portagrpo: stopped by {what}; every checkpoint written so far is whole (continue a training run "
                  f"with --resume).", file=sys.stderr)
        return 130 if isinstance(err, KeyboardInterrupt) else 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return action.choices[name]


def _speaks_for_the_run() -> bool:
    """Whether this process reports a stop: one line per run, so not a rank under portagrpo's own
    launcher (the launcher reports it) and, under a plain torchrun, only rank 0."""
    from portagrpo.procs import LAUNCHER_ENV

    return not os.environ.get(LAUNCHER_ENV) and os.environ.get("RANK", "0") == "0"


# Operating-system refusals that a user fixes (disk, permissions, names), as one sentence each.
_USER_OS_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                   errno.ENOTDIR, errno.EISDIR)


def _dispatch(parser, argv: list[str]) -> int:
    if not argv:  # a bare `portagrpo` asks what it can do; it never starts a training run
        parser.print_help()
        print("\nportagrpo train   # the embedded default: a tiny policy on a built-in task, about a minute on a CPU")
        return 2
    command = COMMANDS.get(argv[0])
    try:
        if command is not None and not command.parsed:
            return command.run(argv[1:])
        if argv[0] == "train":  # options may come before, between or after the key=value overrides
            args = _subparser(parser, "train").parse_intermixed_args(argv[1:])
            args.command = "train"
        else:
            args = parser.parse_args(argv)
        args.argv = argv
        return COMMANDS[args.command].run(args)
    except (UserError, FileNotFoundError) as err:
        return _fail(err)
    except OSError as err:
        if err.errno not in _USER_OS_ERRORS:
            raise
        from portagrpo.fileio import describe_os_error

        return _fail(RuntimeError(describe_os_error(err, err.filename or "a file", "writing or reading")))


if __name__ == "__main__":
    sys.exit(main())

"""`portagrpo hardware-check DEVICE [OUT] [--size full|tiny] [--tests DIR]` (also `ci/hardware-check.sh`):
the whole check of one machine's device, in one command, with one report (report.md + report.json).

Steps, each a separate `portagrpo`/pytest process whose command, exit status, time and output tail
are recorded:
1. `doctor` (what the machine has);
2. `parity` in fp32 and bf16 with every log-prob kernel the backend offers;
3. the device-marked tests (`pytest -m DEVICE tests/parity`). They live in the source tree, not in an
   installed portagrpo: `--tests DIR`, else `tests/parity` under the current directory (a clone, the
   images' WORKDIR), else beside the imported package (an editable install); found nowhere, the step is
   skipped with that reason;
4. a run recorded on the CPU, replayed on DEVICE;
5. a Qwen2.5-0.5B-shaped random-init model (its config written here, nothing downloaded) trained for
   30 steps under every parallel strategy the machine can run (one process; ddp, fsdp2 and ep on two
   devices when it has two; ep trains the tiny Qwen3-MoE, and is skipped with the reason where torchtitan does not
   import) with `rollout.engine` hf and, where vLLM is installed, vllm; the one-process
   hf run's measured peak per phase against `portagrpo plan` for the same config; 30 steps of the
   embedded default; 30 steps under FSDP2 with `actor.offload` on one rank (a group of one);
6. `bench kernels` and `bench step` (tokens/s, and MFU where backends/peaks.py has the device's peak).

`--size tiny` shrinks every step (a tiny model, 2 steps, small benchmark shapes) so that CI runs the
script itself on `cpu` and `emu` within minutes; the report says which size ran. A step that cannot run
here (no second device, no vLLM) is recorded as skipped with the reason, never as passed.

The check depends on no source tree and on no working directory: OUT is made absolute once, and every
step runs in OUT as `python -P -m portagrpo` (procs.portagrpo_command), so a relative OUT and a source
tree in the caller's directory (the images keep their WORKDIR at one) change nothing.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from portagrpo.fileio import write_text_atomic
from portagrpo.procs import portagrpo_command

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "vocab_size": 151936}  # Qwen2.5-0.5B's config.json shape
# head size 32: the smallest vLLM's CPU attention runs (a tiny check with vLLM installed runs it too)
TINY_QWEN = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 512, "rope_theta": 10000.0,
             "tie_word_embeddings": True}
SIZES = {
    "full": {"steps": 30, "record_steps": 5, "shapes": None, "bench_steps": 3, "model": QWEN25_05B,
             "batch": ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=32",
                       "actor.micro_batch_size=8", "data.max_response_length=64"]},
    "tiny": {"steps": 2, "record_steps": 2, "shapes": "64x32x128", "bench_steps": 1, "model": TINY_QWEN,
             "batch": ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                       "actor.micro_batch_size=2", "data.max_response_length=8", "data.train_size=16"]},
}
QUIET = ["trainer.test_freq=0", "trainer.save_freq=0", "trainer.plot=false", "trainer.tensorboard=false",
         "trainer.progress_bar=false"]
TESTS = Path("tests") / "parity"  # the device-marked tests, relative to a source tree's root


class Check:
    def __init__(self, device: str, out: Path, size: str, log=print) -> None:
        self.device, self.out, self.size, self.log = device, out, size, log
        self.steps: list[dict[str, Any]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def run(self, name: str, argv: list[str], *, ok_codes=(0,), skip_codes: dict[int, str] | None = None,
            timeout_s: float = 3600) -> dict[str, Any]:
        self.log(f"[hardware-check] {name}: {' '.join(argv)}")
        start = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout_s,
                                  cwd=self.out)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code, output = 124, f"timed out after {timeout_s:.0f}s\n{err.stdout or ''}"
        status = ("passed" if code in ok_codes else "skipped" if skip_codes and code in skip_codes else "failed")
        step = {"step": name, "command": " ".join(argv), "status": status, "exit": code,
                "seconds": round(time.monotonic() - start, 1), "tail": output.strip().splitlines()[-12:]}
        self.last_output = output
        if status == "skipped":
            step["reason"] = skip_codes[code]
        self.steps.append(step)
        return step

    def skip(self, name: str, reason: str) -> None:
        self.log(f"[hardware-check] {name}: skipped ({reason})")
        self.steps.append({"step": name, "command": "", "status": "skipped", "exit": None, "seconds": 0.0,
                           "reason": reason, "tail": []})


def _cli(*args: str) -> list[str]:
    return portagrpo_command(*args)


def find_device_tests(explicit: Path | None = None) -> tuple[Path | None, str]:
    """The folder of the device-marked tests, or None and the sentence saying why they are not run."""
    if explicit is not None:
        return explicit.resolve(), ""
    source_tree = Path(__file__).resolve().parents[2]  # the clone's root in an editable install
    for candidate in (Path.cwd() / TESTS, source_tree / TESTS):
        if (candidate / "test_parity.py").is_file():
            return candidate.resolve(), ""
    return None, (f"the device-marked tests ({TESTS}) are not here: an installed portagrpo carries no tests; run "
                  "from a clone's root or the image's /opt/portagrpo, or pass --tests CLONE/tests/parity")


def write_model(folder: Path, shape: dict[str, Any]) -> Path:
    """A random-init Qwen2 of the given shape with portagrpo's character tokenizer, saved locally."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from portagrpo.model.loading import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(**{"vocab_size": len(tok), **shape}, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def _backend_facts(device: str) -> dict[str, Any]:
    from portagrpo.backends import get_backend
    from portagrpo.tolerances import DTYPES

    backend = get_backend(device)
    kernels = []
    for name in backend.spec.kernel_choices:
        try:
            if backend.kernel_implementation(name) == name:
                kernels.append(name)
        except Exception:  # noqa: BLE001 - a kernel this machine lacks is left out of the parity call
            continue
    return {"name": backend.name, "devices": backend.device_count(), "kernels": kernels,
            "bf16": backend.supports_dtype(DTYPES["bf16"]), "strategies": backend.spec.parallel_choices,
            "vllm": "vllm" in backend.spec.rollout_engines and _has("vllm")}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_check(device: str, out: Path, size: str = "full", log=print, tests: Path | None = None) -> dict[str, Any]:
    out = Path(out).resolve()  # once: the steps run in OUT, and every path handed to them is absolute
    out.mkdir(parents=True, exist_ok=True)
    s = SIZES[size]
    check = Check(device, out, size, log)
    facts = _backend_facts(device)
    dtype = "bf16" if facts["bf16"] and facts["name"] != "cpu" else "fp32"
    _check_numerics(check, device, out, facts, s, tests)
    model = write_model(out / "model", s["model"])
    _check_training(check, device, out, facts, s, model, dtype)
    shapes = ["--shapes", s["shapes"]] if s["shapes"] else []
    check.run("bench kernels", _cli("bench", "kernels", "--device", device, "--repeats", "1", *shapes,
                                    "--json", str(out / "bench-kernels.json")))
    bench = check.run("bench step", _cli("bench", "step", "--steps", str(s["bench_steps"]), "--warmup", "0",
                                         "--json", str(out / "bench-step.json"), f"trainer.device={device}",
                                         f"model.path={model}", f"model.dtype={dtype}", *s["batch"]))
    if bench["status"] == "passed":
        r = json.loads((out / "bench-step.json").read_text())["results"][0]
        bench["numbers"] = {k: r[k] for k in ("time_step_s", "tokens_per_s_per_device", "model_flops_per_s_per_device",
                                              "mfu", "mfu_peak_source", "matmul_utilization", "mem_peak_gb")}
    report = {"device": device, "backend": facts, "size": size, "host": platform.node(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
              "steps": check.steps, "passed": all(st["status"] != "failed" for st in check.steps)}
    write_text_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_text_atomic(out / "report.md", render(report))
    return report


def _check_numerics(check: Check, device: str, out: Path, facts: dict, s: dict, tests: Path | None) -> None:
    """The doctor, the parity suite, the device-marked tests, and a CPU recording replayed on the device."""
    check.run("doctor", _cli("doctor", "--json"))
    write_text_atomic(out / "doctor.json", check.last_output)
    check.run("parity", _cli("parity", "--device", device, "--dtype", "fp32,bf16", "--kernels",
                             ",".join(facts["kernels"]), "--json", str(out / "parity.json")))
    folder, why_not = find_device_tests(tests)
    if folder is None:
        check.skip("device tests", why_not)
    elif not _has("pytest"):
        check.skip("device tests", "pytest is not installed (pip install pytest)")
    else:
        check.run("device tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", facts["name"],
                                   str(folder), "--junitxml", str(out / "pytest-device.xml")],
                  skip_codes={5: f"no test is marked {facts['name']}"})
    recorded = out / "recorded-on-cpu"
    rec = check.run("record on cpu", _cli("train", "--device", "cpu", "--output-dir", str(recorded), *QUIET,
                                          "trainer.record_rollouts=true", f"trainer.total_steps={s['record_steps']}",
                                          *s["batch"]))
    if rec["status"] == "passed":
        check.run("replay on device", _cli("replay", str(recorded), "--device", device, "--output-dir",
                                           str(out / "replay")))


def _check_training(check: Check, device: str, out: Path, facts: dict, s: dict, model: Path, dtype: str) -> None:
    """Short training runs: one process, then two ranks under each parallel strategy; per engine."""
    ranks = 2 if facts["devices"] >= 2 or facts["name"] == "cpu" else 1
    engines = ["hf"] + (["vllm"] if facts["vllm"] else [])
    if not facts["vllm"]:
        check.skip("runs with rollout.engine=vllm", "vLLM is not installed or does not run on this device")
    for engine in engines:
        layouts = [("one process", 1, "auto")] + [(f"{p} x2", ranks, p) for p in facts["strategies"]]
        for label, nproc, parallel in layouts:
            name = f"{s['steps']}-step run, {label}, {engine}"
            if nproc < 2 and parallel != "auto":
                check.skip(name, "this machine has one device")
                continue
            run_dir = str(out / "runs" / f"{engine}-{parallel}")
            # expert parallelism splits a mixture-of-experts model's experts: the tiny Qwen3-MoE, not the saved model
            source = [f"model.path={model}"] if parallel != "ep" else ["model.tiny.moe=qwen3_moe"]
            if parallel == "ep" and _ep_problem():
                check.skip(name, _ep_problem())
                continue
            run = [*source, f"model.dtype={dtype}", f"rollout.engine={engine}",
                   f"trainer.total_steps={s['steps']}", f"trainer.nproc_per_node={nproc}",
                   f"trainer.parallel={parallel}", *s["batch"]]
            step = check.run(name, _cli("train", "--device", device, "--output-dir", run_dir, *QUIET, *run))
            if engine == "hf" and nproc == 1:
                _check_plan(check, device, out, run, Path(run_dir), step["status"] == "passed")
    check.run(f"{s['steps']}-step run, embedded default, one process",
              _cli("train", "--device", device, "--output-dir", str(out / "runs" / "embedded-default"), *QUIET,
                   f"trainer.total_steps={s['steps']}"))
    name = f"{s['steps']}-step run, FSDP2 with actor.offload on one rank"
    if "fsdp2" not in facts["strategies"]:
        check.skip(name, f"the {device} backend has no FSDP2")
    else:
        check.run(name, _cli("train", "--device", device, "--output-dir", str(out / "runs" / "fsdp2-offload-1"),
                             *QUIET, f"model.path={model}", f"model.dtype={dtype}", f"trainer.total_steps={s['steps']}",
                             "trainer.parallel=fsdp2", "actor.offload=true", "actor.ref_offload=true", *s["batch"]))


def _ep_problem() -> str | None:
    from portagrpo.model.expert_parallel import ep_import_problem

    return ep_import_problem()


def _check_plan(check: Check, device: str, out: Path, run: list[str], run_dir: Path, ran: bool) -> None:
    """The one-process run's measured peak per phase (`mem/<phase>_peak_gb`, the largest over its steps) against
    `portagrpo plan` for the same config on one device: the ratio of each phase, recorded, never a pass bar."""
    name = "peak memory against portagrpo plan"
    if not ran:
        check.skip(name, "the one-process run it measures did not pass")
        return
    plan_json = out / "plan.json"
    # the capacities only decide the plan's verdict, not its phases, which are what is compared here
    step = check.run(name, _cli("plan", "--device", device, "--nodes", "1", "--devices-per-node", "1",
                                "--device-memory-gb", "1024", "--host-memory-gb", "4096", "--json", str(plan_json),
                                *[r for r in run if not r.startswith("trainer.nproc_per_node")]))
    if step["status"] != "passed":
        return
    measured: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("mem/") and key.endswith("_peak_gb"):
                measured[key[4:-8]] = max(measured.get(key[4:-8], 0.0), value)
    planned = {k: v["peak_gib"] for k, v in json.loads(plan_json.read_text())["phases"].items()}
    step["phases"] = {k: {"measured_gib": measured[k], "planned_gib": planned[k],
                          "planned_over_measured": planned[k] / measured[k] if measured[k] else None}
                      for k in sorted(set(measured) & set(planned))}
    if device == "cpu":
        step["note"] = "the CPU backend measures the process's resident memory, the plan a device's: not comparable"
    lines = [f"{k}: measured {v['measured_gib']:.3f} GiB, planned {v['planned_gib']:.3f} GiB"
             + (f" ({v['planned_over_measured']:.2f}x)" if v["planned_over_measured"] else "")
             for k, v in step["phases"].items()]
    step["tail"] = ([step["note"]] if "note" in step else []) + lines


def render(report: dict[str, Any]) -> str:
    b = report["backend"]
    lines = [f"# Hardware check: {report['device']} ({report['size']} size)", "",
             f"{report['date']} on {report['host']}, Python {report['python']}; backend {b['name']}, "
             f"{b['devices']} device(s), kernels {', '.join(b['kernels'])}, bf16 {b['bf16']}, vLLM {b['vllm']}.", "",
             "| step | result | seconds | command |", "| --- | --- | --- | --- |"]
    for st in report["steps"]:
        result = st["status"] + (f" ({st['reason']})" if st.get("reason") else "")
        lines.append(f"| {st['step']} | {result} | {st['seconds']} | `{st['command'][:160]}` |")
    numbers = [st for st in report["steps"] if st.get("numbers") or st.get("phases")]
    for st in numbers:
        lines += ["", f"## {st['step']}", ""]
        lines += [f"- {k}: {v}" for k, v in st.get("numbers", {}).items()]
        lines += [f"- {line}" for line in st["tail"]] if st.get("phases") else []
    failed = [st for st in report["steps"] if st["status"] == "failed"]
    for st in failed:
        lines += ["", f"## {st['step']} (exit {st['exit']})", "", "```", *st["tail"], "```"]
    lines += ["", "passed" if report["passed"] else f"{len(failed)} step(s) failed", ""]
    return "\n".join(lines)


def main_cli(argv: list[str]) -> int:
    import argparse

    from portagrpo.fileio import check_output_path

    p = argparse.ArgumentParser(prog="portagrpo hardware-check", description=__doc__.split("\n\n")[0])
    p.add_argument("device", help="cpu|cuda|rocm|npu (or a plugin's device, e.g. emu)")
    p.add_argument("out", nargs="?", default=None, help="report folder (default hardware-check-<device>)")
    p.add_argument("--size", choices=sorted(SIZES), default="full",
                   help="tiny: every step once at the smallest size, in minutes (CI runs the script itself so)")
    p.add_argument("--tests", default=None, help="the source tree's tests/parity folder, for the device-marked "
                   "tests (default: ./tests/parity, else beside the package; skipped, with the reason, if absent)")
    args = p.parse_args(argv)
    out = Path(args.out or f"hardware-check-{args.device}")
    check_output_path(out, "OUT")
    tests = Path(args.tests) if args.tests else None
    if tests is not None and not (tests / "test_parity.py").is_file():
        from portagrpo.errors import UserError

        raise UserError(f"--tests {tests} holds no test_parity.py; give a portagrpo clone's tests/parity folder.")
    out = out.resolve()
    if out.is_dir() and any(out.iterdir()):
        if not (out / "report.json").is_file():
            from portagrpo.errors import UserError

            raise UserError(f"OUT {out} is not empty and holds no earlier hardware-check report; pick a new folder.")
        import shutil

        shutil.rmtree(out)  # an earlier report of this command: replaced whole
    report = run_check(args.device, out, args.size, tests=tests)
    print(render(report))
    print(f"report: {out / 'report.md'} and {out / 'report.json'}")
    return 0 if report["passed"] else 1

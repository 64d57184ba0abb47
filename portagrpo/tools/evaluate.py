"""`portagrpo eval --model PATH|RUN_DIR --data FILE [--n K]`: greedy accuracy, and pass@k /
mean@k from k samples per prompt, on any backend, batched, with a JSON report."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from portagrpo.fileio import check_report_destination, write_report
from portagrpo.metrics import pass_at_k

PIXELS_FIELD = "--max-image-pixels"  # eval's data.max_image_pixels


def load_for_eval(model: str | Path, allow_untrained: bool = False):
    """(model, tokenizer, processor, description) from a model path, a .gguf, or a run directory's newest
    checkpoint. `processor`: a vision-language model's (its tokenizer is `tokenizer`), else None."""
    from portagrpo.checkpoint import SHARDS, latest_valid_checkpoint, load_model_shards
    from portagrpo.config import load_config
    from portagrpo.errors import UserError
    from portagrpo.model.loading import load_model

    path = Path(str(model))
    is_run = (path / "config.yaml").is_file() and ((path / "checkpoints").is_dir() or (path / "init_model").is_dir())
    if is_run:
        ckpt = latest_valid_checkpoint(path, warn=print)
        cfg = load_config(path / "config.yaml", check_files=False)
        base = cfg.model.path or str(path / "init_model")
        if ckpt is None and not allow_untrained:
            raise UserError(
                f"--model {path} is a run with no whole checkpoint: evaluating it would measure the untrained "
                f"initial model; pass --untrained to do that on purpose, or train with trainer.save_freq > 0."
            )
        if ckpt is None:
            return load_model(base, "sdpa"), *text_side(cfg.model.tokenizer_path or base), f"{base} (no checkpoint)"
        model_dir = ckpt / "model"
        if (ckpt / SHARDS).is_dir():  # FSDP2's sharded format: the base model, its weights read from the shards
            model = load_model(base, "sdpa")
            load_model_shards(ckpt, model)
            return model, *text_side(model_dir), f"{ckpt} (sharded)"
        if (model_dir / "adapter_config.json").is_file():
            from peft import PeftModel

            merged = PeftModel.from_pretrained(load_model(base, "sdpa"), str(model_dir)).merge_and_unload()
            return merged, *text_side(cfg.model.tokenizer_path or base), f"{model_dir} (LoRA merged)"
        return load_model(model_dir, "sdpa"), *text_side(model_dir), str(model_dir)
    if not str(model).startswith("pkg:") and not path.exists():
        raise UserError(
            f"--model {str(model)!r} does not exist; give a model directory, a .gguf file or a run directory."
        )
    return load_model(model, "sdpa", "--model"), *text_side(model, "--model"), str(model)


def text_side(path: str | Path, field: str = "model.path"):
    """(tokenizer, processor) of a model directory: a vision-language model's directory holds its processor,
    whose tokenizer is the model's; any other gives (tokenizer, None)."""
    from portagrpo.model.loading import load_tokenizer
    from portagrpo.model.vision import load_processor
    from portagrpo.paths import has_processor

    if has_processor(path):
        processor = load_processor(path, field)
        return processor.tokenizer, processor
    return load_tokenizer(str(path), field), None


def evaluate(model_spec: str, data_files: list[str], *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = -1, min_p: float = 0.0, repetition_penalty: float = 1.0,
             max_new_tokens: int = 256, batch_size: int = 16, device: str = "auto", reward: str = "auto",
             seed: int = 0, progress: bool = True, max_samples: int | None = None,
             allow_untrained: bool = False, max_image_pixels: int | None = None, log=print) -> dict[str, Any]:
    from portagrpo.backends import get_backend
    from portagrpo.data.images import image_limits, shrink_notice
    from portagrpo.data.records import load_records
    from portagrpo.errors import UserError
    from portagrpo.rewards.functions import RewardResolver
    from portagrpo.rollout.engines import HFRollout
    from portagrpo.rollout.settings import SamplingParams

    backend = get_backend(device)
    keys = dict(max_image_pixels=max_image_pixels, pixels_field=PIXELS_FIELD)
    records = load_records(data_files, **keys)[:max_samples]
    if not records:
        raise UserError(f"--data {', '.join(map(str, data_files))} holds no prompts; give a file with rows.")
    model, tokenizer, processor, described = load_for_eval(model_spec, allow_untrained)
    if processor is not None:  # read again, each image checked against the model's processor as a training run does
        records = load_records(data_files, processor=processor, **keys)[:max_samples]
    shrunk = shrink_notice(records, image_limits(max_image_pixels, processor, PIXELS_FIELD))
    if shrunk:
        log(shrunk)
    with_images = next((r for r in records if r.images), None)
    if processor is None and with_images is not None:
        raise UserError(f"--data prompt {with_images.index} has images but --model {model_spec} is text-only (no "
                        f"processor files beside it); give a vision-language model or run, or data without images.")
    model.to(backend.device(0)).eval()
    resolver = RewardResolver(reward)
    resolver.check_sources({r.data_source for r in records})
    engine = HFRollout(model, tokenizer, lambda: backend.autocast(torch.float32))
    # Exactly these settings: nothing is taken from the model's generation_config (see rollout/engines.py).
    runs = [("greedy", 1, SamplingParams(max_new_tokens, 0.0, repetition_penalty=repetition_penalty))]
    if n > 1:
        runs.append(
            ("sampled", n, SamplingParams(max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty))
        )
    report: dict[str, Any] = {"model": described, "data": [str(f) for f in data_files], "prompts": len(records),
                              "device": backend.name, "n": n}
    for name, k, params in runs:
        backend.seed(seed)
        correct, scores, examples = _sample_and_score(engine, tokenizer, processor, records, k, params, resolver,
                                                      batch_size, backend.device(0), name, progress)
        summary = {"reward_mean": sum(map(sum, scores)) / max(1, sum(map(len, scores))),
                   "examples": examples}
        if name == "greedy":
            summary["accuracy"] = sum(c[0] for c in correct) / max(1, len(correct))
        else:
            summary[f"mean@{k}"] = sum(sum(c) / k for c in correct) / max(1, len(correct))
            summary["pass@1"] = sum(pass_at_k(k, sum(c), 1) for c in correct) / max(1, len(correct))
            summary[f"pass@{k}"] = sum(pass_at_k(k, sum(c), k) for c in correct) / max(1, len(correct))
            summary.update(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        summary["repetition_penalty"] = repetition_penalty
        report[name] = summary
    return report


def _sample_and_score(engine, tokenizer, processor, records: list, k: int, params, resolver, batch_size: int, device,
                      name: str, progress: bool) -> tuple[list[list[float]], list[list[float]], list[dict[str, Any]]]:
    """Per prompt: its k samples' correctness and scores, in batches of prompts; the first 10 examples."""
    from tqdm.auto import tqdm

    from portagrpo.rewards.functions import score_responses
    from portagrpo.rollout.generators import GeneratorInputs, GeneratorSpec, make_generator, one_round

    # each prompt as training samples it: a vision-language policy's with its images
    rows = make_generator(GeneratorSpec("vision" if processor is not None else "text"),
                          GeneratorInputs(tokenizer, processor))
    correct, scores, examples = [], [], []
    bar = tqdm(total=len(records), desc=f"eval ({name})", disable=not progress)
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        rb = one_round(rows, engine, chunk, k, params, device)
        texts = rb.response_text
        scored = score_responses(resolver, texts, rb.ground_truth, rb.data_source, rb.prompt_index.tolist(),
                                 rb.extra_info, max_error_frac=1.0)
        for i, rec in enumerate(chunk):
            correct.append(scored.correct[i * k:(i + 1) * k])
            scores.append(scored.scores[i * k:(i + 1) * k])
            if len(examples) < 10:
                examples.append({"index": rec.index, "ground_truth": rec.ground_truth, "response": texts[i * k],
                                 "correct": scored.correct[i * k]})
        bar.update(len(chunk))
    bar.close()
    return correct, scores, examples


def _check_args(args) -> None:
    """Everything that would otherwise fail after the whole evaluation, or mid-way with a traceback."""
    from portagrpo.errors import UserError

    for name in ("n", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1.")
    if args.max_samples is not None and args.max_samples < 1:
        raise UserError(f"--max-samples={args.max_samples} must be at least 1.")
    from portagrpo.data.images import max_pixels_problem

    pixels = max_pixels_problem(args.max_image_pixels, PIXELS_FIELD)
    if pixels:
        raise UserError(pixels)
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature={args.temperature} must be a positive number (greedy always runs).")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p={args.top_p} must be in (0, 1].")
    if args.top_k < -1 or not 0 <= args.min_p < 1 or not args.repetition_penalty > 0:
        raise UserError(f"--top-k={args.top_k} must be >= -1, --min-p={args.min_p} in [0, 1) and --repetition-penalty="
                        f"{args.repetition_penalty} positive.")
    if args.output is None:
        return
    out = Path(args.output)
    if not out.parent.is_dir():
        raise UserError(f"--output {out}: the directory {out.parent} does not exist; create it first.")
    if out.is_dir():
        raise UserError(f"--output {out} is a directory; name the JSON file to write.")
    check_report_destination(out, "--output", "eval")  # a new file, or an earlier eval report


def fresh_report_path(stem: str = "eval") -> Path:
    """`eval-<time>.json` in the working directory, never an existing file."""
    from datetime import datetime

    base = f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, k = Path(f"{base}.json"), 1
    while path.exists():
        k += 1
        path = Path(f"{base}-{k}.json")
    return path


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo eval")
    p.add_argument("--model", required=True, help="model directory, .gguf file, pkg:PACKAGE/FILE, or run directory")
    p.add_argument(
        "--data", required=True, action="append", help="JSONL or Parquet in the training schema (repeatable)"
    )
    p.add_argument("--n", type=int, default=1, help="samples per prompt for pass@k / mean@k (greedy is always run)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0: off (the model's generation_config is not used)")
    p.add_argument("--min-p", type=float, default=0.0, help="0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off (applies to greedy too)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-image-pixels", type=int, default=None, help="as data.max_image_pixels: a larger image is "
                   "refused; default: the model's own limit (an image its processor would shrink is refused)")
    p.add_argument("--device", default="auto")
    p.add_argument("--reward", default="auto", help="reward function (as reward.function)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output",
        default=None,
        help="the JSON report: a new file or an earlier eval report (default: a new "
        "eval-<time>.json in the working directory)",
    )
    p.add_argument(
        "--untrained", action="store_true", help="allow a run directory without a checkpoint (its init model)"
    )
    args = p.parse_args(argv)
    _check_args(args)
    report = evaluate(args.model, args.data, n=args.n, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device=args.device,
                      reward=args.reward, seed=args.seed, max_samples=args.max_samples, allow_untrained=args.untrained,
                      max_image_pixels=args.max_image_pixels)
    output = Path(args.output) if args.output else fresh_report_path()
    write_report(output, report, "eval")
    g = report["greedy"]
    line = f"greedy accuracy {g['accuracy']:.3f} (mean reward {g['reward_mean']:.3f}) on {report['prompts']} prompts"
    if "sampled" in report:
        s = report["sampled"]
        line += (f"; n={args.n}: pass@1 {s['pass@1']:.3f}, pass@{args.n} {s[f'pass@{args.n}']:.3f}, "
                 f"mean@{args.n} {s[f'mean@{args.n}']:.3f}")
    print(line + f"; report in {output}")
    return 0

"""`portagrpo data gsm8k|math --input FILE --output DIR`: the public datasets' own files in the
training schema (chat `prompt` with an instruction, `reward_model.ground_truth`, `data_source`,
`extra_info`). Nothing is downloaded; malformed lines are reported with their line number and
skipped (`--on-error skip`) or rejected (`--on-error fail`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from portagrpo.data.records import DataError
from portagrpo.fileio import atomic_path, check_output_path
from portagrpo.rewards.functions import normalize_number
from portagrpo.rewards.math_answers import extract_boxed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _read_items(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed item or an Exception) for a .jsonl, a .json (object or list), or a folder of .json files."""
    if path.is_dir():
        for f in sorted(path.rglob("*.json")):
            yield from _read_items(f)
        return
    if not path.is_file():
        raise DataError(f"--input {str(path)!r} does not exist; give the dataset's .jsonl/.json file or folder.")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            yield f"{path}", ValueError(f"not valid JSON ({err.msg})")
            return
        for i, item in enumerate(data if isinstance(data, list) else [data]):
            yield f"{path}" + (f" item {i + 1}" if isinstance(data, list) else ""), item
        return
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                yield f"{path}:{lineno}", ValueError(f"not valid JSON ({err.msg})")


def _gsm8k_row(item: dict, index: int, split: str) -> dict:
    question, answer = item.get("question"), item.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise ValueError("needs string fields 'question' and 'answer'")
    if "####" not in answer:
        raise ValueError("the answer has no '#### <final answer>'")
    truth = normalize_number(answer.split("####")[-1].strip())
    if truth is None:
        raise ValueError(f"the final answer {answer.split('####')[-1].strip()!r} is not a number")
    return {"prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "data_source": "openai/gsm8k",
            "extra_info": {"split": split, "index": index, "question": question, "answer": answer}}


def _math_row(item: dict, index: int, split: str) -> dict:
    problem, solution = item.get("problem"), item.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str):
        raise ValueError("needs string fields 'problem' and 'solution'")
    truth = extract_boxed(solution)
    if not truth:
        raise ValueError("the solution has no \\boxed{...} answer")
    extra = {"split": split, "index": index}
    for key in ("level", "type", "subject", "unique_id"):
        if key in item:
            extra[key] = item[key]
    return {"prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "data_source": "hendrycks/math",
            "extra_info": extra}


CONVERTERS = {"gsm8k": _gsm8k_row, "math": _math_row}


def convert(kind: str, input_path: str | Path, output_dir: str | Path, *, split: str | None = None,
            on_error: str = "skip", fmt: str = "parquet", log=print) -> tuple[Path, int, list[str]]:
    """Returns (written file, rows written, problems)."""
    input_path, output_dir = Path(input_path), Path(output_dir)
    split = split if split is not None else (input_path.stem if input_path.is_file() else input_path.name)
    check_split(split)
    check_output(output_dir, split, fmt)
    rows, problems = [], []
    for where, item in _read_items(input_path):
        try:
            if isinstance(item, Exception):
                raise item
            if not isinstance(item, dict):
                raise ValueError(f"expected a JSON object, got {type(item).__name__}")
            rows.append(CONVERTERS[kind](item, len(rows), split))
        except ValueError as err:
            problem = f"{where}: {err}"
            if on_error == "fail":
                raise DataError(f"{problem}; fix the line or use --on-error skip.") from None
            problems.append(problem)
    for problem in problems[:20]:
        log(f"skipped {problem}")
    if len(problems) > 20:
        log(f"... and {len(problems) - 20} more skipped lines")
    if not rows:
        raise DataError(f"--input {str(input_path)!r} gave no usable {kind} rows.")
    out = output_dir / f"{split}.{fmt}"
    with atomic_path(out, what="writing") as tmp:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pylist(rows)
            pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}), MARK: kind.encode()}), tmp)
        else:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, len(rows), problems


MARK = b"portagrpo_data"  # Parquet metadata key: a file `portagrpo data` wrote and may replace


def check_split(split: str) -> None:
    """The split names the file written inside --output, so it must be a plain name: no folder part
    (`../x` or `a/b` would write elsewhere), not hidden, no control characters."""
    plain = (split and not split.startswith(".") and "/" not in split and "\\" not in split
             and all(ch.isprintable() for ch in split))
    if not plain:
        raise DataError(f"split name {split!r} (--split, or else the input's name) is not a plain name: the file is "
                        f"written as <split>.<format> inside --output, so it takes no '/', '\\', leading '.' or "
                        f"control characters; pass e.g. --split train (nothing was written).")


def check_output(output_dir: str | Path, split: str, fmt: str) -> None:
    """Before any work: --output is a directory (or can become one), and the file it would write is
    new or an earlier `portagrpo data` Parquet file; anything else is never replaced."""
    check_output_path(output_dir, "--output")
    out = Path(output_dir) / f"{split}.{fmt}"
    if not out.exists():
        return
    if out.is_dir():
        raise DataError(f"--output {output_dir}: {out} is a directory; pick another --output or --split.")
    ours = False
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            ours = MARK in (pq.read_schema(out).metadata or {})
        except Exception:  # noqa: BLE001 - not Parquet at all: not ours
            ours = False
    if not ours:
        raise DataError(f"--output {output_dir}: {out} already exists and was not written by `portagrpo data`; pick "
                        f"another --output or --split, or move the file away (nothing was written).")


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo data")
    p.add_argument("kind", choices=sorted(CONVERTERS))
    p.add_argument(
        "--input", required=True, help="GSM8K JSONL (question/answer) or MATH JSON/JSONL/folder (problem/solution)"
    )
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--split", default=None, help="split name (default: the input file's name)")
    p.add_argument("--on-error", choices=["skip", "fail"], default="skip")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = p.parse_args(argv)
    out, n, problems = convert(args.kind, args.input, args.output, split=args.split, on_error=args.on_error,
                               fmt=args.format)
    print(f"wrote {n} rows to {out}" + (f"; skipped {len(problems)} malformed" if problems else ""))
    return 0

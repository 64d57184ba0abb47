"""`portagrpo data gsm8k|math|geo3k --input FILE --output DIR`: the public datasets' own files in the
training schema (chat `prompt` with an instruction, `reward_model.ground_truth`, `data_source`,
`extra_info`; geo3k adds `images`, verl's multimodal layout). Nothing is downloaded; malformed lines are
reported with their line number and skipped (`--on-error skip`) or rejected (`--on-error fail`)."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterator

from portagrpo.data.images import IMAGE_PLACEHOLDER, ImageLimits, ImageProblem, row_images
from portagrpo.data.records import DataError
from portagrpo.fileio import atomic_path, check_output_path
from portagrpo.rewards.functions import normalize_number
from portagrpo.rewards.math_answers import extract_boxed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# What the geo3k reward checks (rewards/geo3k.py): reasoning inside <think> </think>, then a \boxed{} answer.
GEO3K_INSTRUCTION = ("First reason about the problem step by step inside <think> </think> tags, then give "
                     "the final answer inside \\boxed{}.")
GEO3K_SOURCE = "hiyouga/geometry3k"


def _read_items(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed item or an Exception) for a .jsonl, a .json (object or list), or a folder of .json files."""
    if path.is_dir():
        for f in sorted(path.rglob("*.json")):
            yield from _read_items(f)
        return
    if not path.is_file():
        raise DataError(f"--input {str(path)!r} does not exist; give the dataset's .jsonl/.json file or folder.")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"--input {str(path)!r} is not a readable Parquet file ({type(err).__name__}); "
                            f"give the dataset's .parquet, .jsonl or .json file.") from None
        for i, row in enumerate(rows):
            yield f"{path} row {i + 1}", row
        return
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


def _geo3k_row(item: dict, index: int, split: str, base: Path = Path(".")) -> dict:
    """hiyouga/geometry3k's layout (problem with its `<image>` placeholder, answer, images) -> verl's geo3k row."""
    problem, answer = item.get("problem"), item.get("answer")
    if not isinstance(problem, str) or not problem.strip() or not isinstance(answer, str) or not answer.strip():
        raise ValueError("needs non-empty string fields 'problem' and 'answer'")
    try:
        images = row_images(item.get("images"), problem, base, ImageLimits())  # the processor is not known here
    except ImageProblem as err:
        raise ValueError(str(err)) from None
    if not images:
        raise ValueError(f"has no image; a geo3k problem needs its figure and an {IMAGE_PLACEHOLDER} placeholder")
    names = [e.get("path") if isinstance(e, dict) else (e if isinstance(e, str) else None) for e in item["images"]]
    return {"prompt": [{"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
            "images": [{"bytes": data, "path": name} for data, name in zip(images, names)],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer.strip()},
            "data_source": GEO3K_SOURCE,
            "extra_info": {"split": split, "index": index, "answer": answer, "question": problem}}


CONVERTERS = {"gsm8k": _gsm8k_row, "math": _math_row, "geo3k": _geo3k_row}


def convert(kind: str, input_path: str | Path, output_dir: str | Path, *, split: str | None = None,
            on_error: str = "skip", fmt: str = "parquet", log=print) -> tuple[Path, int, list[str]]:
    """Returns (written file, rows written, problems)."""
    input_path, output_dir = Path(input_path), Path(output_dir)
    split = split if split is not None else (input_path.stem if input_path.is_file() else input_path.name)
    check_split(split)
    check_output(output_dir, split, fmt)
    rows, problems = [], []
    # geo3k's image paths are relative to the input's folder
    extra = {"base": input_path if input_path.is_dir() else input_path.parent} if kind == "geo3k" else {}
    for where, item in _read_items(input_path):
        try:
            if isinstance(item, Exception):
                raise item
            if not isinstance(item, dict):
                raise ValueError(f"expected a JSON object, got {type(item).__name__}")
            rows.append(CONVERTERS[kind](item, len(rows), split, **extra))
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

            table = _with_image_type(pa.Table.from_pylist(rows))
            pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}), MARK: kind.encode()}), tmp)
        else:
            tmp.write_text("".join(json.dumps(_jsonable(r)) + "\n" for r in rows))
    return out, len(rows), problems


def _with_image_type(table):
    """`images` typed as the Hugging Face Image feature stores it, list<struct<bytes: binary, path: string>>
    (an all-null `path` would otherwise be inferred as the null type)."""
    import pyarrow as pa

    if "images" not in table.column_names:
        return table
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    column = pa.array(table.column("images").to_pylist(), type=pa.list_(image))
    return table.set_column(table.column_names.index("images"), "images", column)


def _jsonable(row: dict) -> dict:
    """JSONL cannot hold bytes: image bytes are written as base64 text, which the loader reads back."""
    if "images" not in row:
        return row
    return {**row, "images": [{"bytes": base64.b64encode(im["bytes"]).decode("ascii"), "path": im["path"]}
                              for im in row["images"]]}


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
        "--input", required=True, help="GSM8K JSONL (question/answer), MATH JSON/JSONL/folder (problem/solution) or "
        "geo3k Parquet/JSONL (problem/answer/images, hiyouga/geometry3k's layout)"
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

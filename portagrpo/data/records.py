"""Prompt datasets: JSONL/Parquet files or built-in tasks, tokenisation, and a resumable loader."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from portagrpo.data.images import ImageLimits, ImageProblem, image_limits, row_images
from portagrpo.data.tasks import TASKS
from portagrpo.errors import UserError
from portagrpo.fileio import write_text_atomic


class DataError(UserError, ValueError):
    """A dataset file is missing or malformed; the message names the file, line and field."""


@dataclass
class PromptRecord:
    index: int
    prompt: Any  # str or list of chat messages
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)
    token_ids: list[int] | None = None  # the prompt's tokens when they were truncated (data.truncation)
    # Encoded images (PNG/JPEG bytes, checked at load: data/images.py), one per `<image>` placeholder of the
    # prompt, in order; decoded only by the processor. Empty for a text-only row.
    images: tuple[bytes, ...] = ()


def _record_from_row(row: dict, index: int, where: str, prompt_key: str = "prompt",
                     source_key: str = "data_source", image_key: str = "images", base: Path | None = None,
                     limits: ImageLimits | None = None) -> PromptRecord:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}.")
    if prompt_key not in row:
        hint = "" if prompt_key != "prompt" else " (a string or a list of chat messages; data.prompt_key names it)"
        raise DataError(f"{where}: the row has no {prompt_key!r} field{hint}.")
    prompt = row[prompt_key]
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, list):
        for m in prompt:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: 'prompt' messages need 'role' and 'content' keys.")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be a string or a list of chat messages.")
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise DataError(f"{where}: 'prompt' is empty; remove the row or give it a prompt.")
    rm = row.get("reward_model") or {}
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DataError(f"{where}: the row has no 'reward_model.ground_truth' field.")
    if rm["ground_truth"] is None:
        raise DataError(f"{where}: 'reward_model.ground_truth' is null; give the expected answer (a string or number).")
    extra = row.get("extra_info") or {}
    try:
        images = row_images(row.get(image_key), prompt, base or Path("."), limits or ImageLimits())
    except ImageProblem as err:
        raise DataError(f"{where} {err} (data.image_key={image_key!r}); fix or remove the row "
                        f"(the file was not changed).") from None
    return PromptRecord(index, prompt, str(rm["ground_truth"]), str(row.get(source_key, "unknown")),
                        dict(extra) if isinstance(extra, dict) else {}, images=images)


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {str(path)!r} is a directory; give a .jsonl or .parquet file.")
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist; give a .jsonl or .parquet file.")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DataError(f"data file {str(path)!r} is not a readable Parquet file ({type(err).__name__}: "
                            f"{str(err)[:120]}); convert it, or name a JSONL file .jsonl.") from None
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"data file {str(path)!r} has an unknown extension; use .jsonl or .parquet.")
    rows = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 (byte {err.start}); re-encode the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or remove the line.") from err
    return rows


def load_records(paths: list[str], prompt_key: str = "prompt", source_key: str = "data_source",
                 image_key: str = "images", max_image_pixels: int | None = None, processor=None,
                 pixels_field: str = "data.max_image_pixels") -> list[PromptRecord]:
    """Every row of the files; a bad row stops the load with one sentence naming its file and row. Files are
    only read, never written. Images are checked against data.max_image_pixels and the policy's `processor`
    (data/images.py: `image_limits`)."""
    try:
        limits = image_limits(max_image_pixels, processor, pixels_field)
    except ImageProblem as err:
        raise DataError(str(err)) from None
    records: list[PromptRecord] = []
    for path in paths:
        base = Path(path).parent
        for i, row in enumerate(read_rows(path)):
            records.append(_record_from_row(row, len(records), f"{path} row {i + 1}", prompt_key, source_key,
                                            image_key, base, limits))
    return records


def task_records(task: str, size: int, seed: int) -> list[PromptRecord]:
    rows = TASKS.get(task, field="data.task")(size, seed)
    return [_record_from_row(r, i, f"task {task} row {i}") for i, r in enumerate(rows)]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def render_prompt(tokenizer, prompt: Any, tools: list[dict] | None = None) -> str:
    """Chat messages go through the tokenizer's chat template when it has one, with the tools' schemas where the run
    has tools (multi-turn: the template lists them for the model, so they are part of the prompt's length)."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in prompt) + "\n"


def tokenize_prompts(tokenizer, records: list[PromptRecord], tools: list[dict] | None = None) -> list[list[int]]:
    return [list(r.token_ids) if r.token_ids is not None
            else tokenizer(render_prompt(tokenizer, r.prompt, tools), add_special_tokens=False)["input_ids"]
            for r in records]


def filter_long_prompts(tokenizer, records: list[PromptRecord], max_len: int,
                        tools: list[dict] | None = None) -> tuple[list[PromptRecord], int]:
    """Drop prompts longer than `max_len` tokens (truncating would change the question), measured as the model sees
    them (with the tools' schemas of a multi-turn run)."""
    ids = tokenize_prompts(tokenizer, records, tools)
    kept = [r for r, x in zip(records, ids) if len(x) <= max_len]
    return kept, len(records) - len(kept)


def truncate_long_prompts(tokenizer, records: list[PromptRecord], max_len: int, side: str,
                          what: str, tools: list[dict] | None = None) -> tuple[list[PromptRecord], int]:
    """Prompts over `max_len` tokens keep their last (`left`) or first (`right`) max_len tokens; with
    `error`, the first one stops the run with a sentence naming it. Returns (records, how many were cut)."""
    out, cut = [], 0
    for record, ids in zip(records, tokenize_prompts(tokenizer, records, tools)):
        if len(ids) > max_len:
            if side == "error":
                raise DataError(f"{what} prompt {record.index} has {len(ids)} tokens, over data.max_prompt_length="
                                f"{max_len}; raise it, set data.filter_overlong_prompts=true to drop such prompts, "
                                f"or data.truncation=left|right to cut them.")
            record = replace(record, token_ids=ids[-max_len:] if side == "left" else ids[:max_len])
            cut += 1
        out.append(record)
    return out, cut


def left_pad(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to [B, P] ids and mask (P = the longest, or `width`)."""
    width = max(max(len(s) for s in seqs), width or 0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


class PromptLoader:
    """Yields batches of prompts, reshuffled each epoch from (seed, epoch); its state resumes exactly."""

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if len(records) < batch_size:
            raise DataError(
                f"the training set has {len(records)} prompts, fewer than data.train_batch_size={batch_size}; "
                f"add data or lower the batch size."
            )
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.records) // self.batch_size

    def next_batch(self) -> list[PromptRecord]:
        if self.cursor + self.batch_size > len(self.records):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return [self.records[i] for i in idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)

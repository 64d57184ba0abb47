"""Reward functions by name, user reward functions by `path/to/file.py:function_name`,
and batch scoring that reports failures instead of training on garbage.
"""
from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Protocol

from .errors import UserError
from .registry import Registry
from .tasks import repeat_reward


class RewardFn(Protocol):
    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> Any:
        """Return a float score, or a dict with a float `score` (and optionally `correct`)."""


class RewardFunctionError(UserError, RuntimeError):
    """A reward function raised or returned a non-finite score too often."""


class RewardSpecError(UserError, ValueError):
    """`reward.function` names something that cannot be loaded."""


REWARDS: Registry[RewardFn] = Registry("reward function")

# ---------------------------------------------------------------- GSM8K-style answers

_NUM = r"-?\$?\s*[\d,]*\.?\d+"
_HASH_RE = re.compile(r"####\s*(" + _NUM + ")")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*(" + _NUM + ")", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$42' -> '42', '7.' -> '7'; None when not a number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer in the `#### 42` form, else the 'the answer is 42' form; normalised."""
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        matches = pattern.findall(text)
        if matches:
            return normalize_number(matches[-1])
    return None


@REWARDS.register("gsm8k")
def gsm8k_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    predicted = extract_gsm8k_answer(solution_str)
    truth = normalize_number(str(ground_truth))
    correct = predicted is not None and predicted == truth
    return {"score": 1.0 if correct else 0.0, "correct": correct}


@REWARDS.register("repeat")
def repeat_task_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    score = repeat_reward(solution_str, str(ground_truth))
    return {"score": score, "correct": score >= 1.0}


# data_source -> registered reward, used by reward.function=auto
DATA_SOURCE_REWARDS = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "portagrpo/arith": "gsm8k",
    "portagrpo/repeat": "repeat",
}


def load_user_function(spec: str) -> RewardFn:
    """Load `path/to/file.py:function_name`."""
    file_part, _, name = spec.rpartition(":")
    path = Path(file_part)
    if not file_part or not name:
        raise RewardSpecError(f"reward.function={spec!r} must be a registered name or path/to/file.py:function_name.")
    if not path.is_file():
        raise RewardSpecError(f"reward.function={spec!r}: the file {file_part!r} does not exist.")
    module_spec = importlib.util.spec_from_file_location(f"portagrpo_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardSpecError(f"reward.function={spec!r}: {file_part!r} defines no function named {name!r}.")
    return fn


class RewardResolver:
    """Maps each sample to its reward function: one fixed function, or by data_source (`auto`)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fixed: RewardFn | None = None
        if spec != "auto":
            self.fixed = load_user_function(spec) if ":" in spec else REWARDS.get(spec, field="reward.function")

    def check_sources(self, sources: set[str]) -> None:
        if self.fixed is not None:
            return
        unknown = sorted(s for s in sources if s not in DATA_SOURCE_REWARDS)
        if unknown:
            raise RewardSpecError(
                f"reward.function=auto has no reward for data_source {unknown[0]!r}; set reward.function to one of "
                f"{', '.join(REWARDS)} or to path/to/file.py:function_name."
            )

    def __call__(self, data_source: str) -> RewardFn:
        if self.fixed is not None:
            return self.fixed
        return REWARDS.get(DATA_SOURCE_REWARDS[data_source])


@dataclass
class RewardFailure:
    sample: int
    prompt_id: int
    message: str


@dataclass
class ScoredBatch:
    scores: list[float]
    correct: list[bool]
    failures: list[RewardFailure] = field(default_factory=list)


def _as_score(result: Any) -> tuple[float, bool | None]:
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"returned a dict without a 'score' key: {sorted(result)}")
        score, correct = result["score"], result.get("correct")
    else:
        score, correct = result, None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        try:
            score = float(score)
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(score).__name__} {score!r}, not a number") from None
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, (bool(correct) if correct is not None else None)


def score_responses(
    resolver: RewardResolver,
    responses: list[str],
    ground_truths: list[str],
    data_sources: list[str],
    prompt_ids: list[int],
    extra_infos: list[dict] | None = None,
    *,
    max_error_frac: float = 0.0,
) -> ScoredBatch:
    """Score every response; a failure scores 0 and is recorded. More failures than
    `max_error_frac` of the batch stop the run with the first failure's details."""
    out = ScoredBatch([], [])
    for i, text in enumerate(responses):
        fn = resolver(data_sources[i])
        try:
            result = fn(data_sources[i], text, ground_truths[i], (extra_infos or [{}] * len(responses))[i])
            score, correct = _as_score(result)
        except Exception as err:  # noqa: BLE001 - a user function may raise anything; we report it
            out.failures.append(RewardFailure(i, prompt_ids[i], f"{type(err).__name__}: {err}"))
            score, correct = 0.0, False
        out.scores.append(score)
        out.correct.append(score >= 1.0 if correct is None else correct)
    if out.failures and len(out.failures) > max_error_frac * len(responses):
        first = out.failures[0]
        raise RewardFunctionError(
            f"the reward function failed on {len(out.failures)} of {len(responses)} samples (first: sample "
            f"{first.sample}, prompt id {first.prompt_id}: {first.message}); fix the function or raise "
            f"reward.max_error_frac to tolerate (and zero-score) failures."
        )
    return out

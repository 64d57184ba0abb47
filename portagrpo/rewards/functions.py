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

from portagrpo.errors import UserError
from portagrpo.registry import Registry
from portagrpo.rewards.geo3k import geo3k_reward
from portagrpo.rewards.tasks import calc_reward, colour_reward, repeat_reward


class RewardFn(Protocol):
    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> Any:
        """Return a float score, or a dict with a float `score` (and optionally `correct`)."""


class RewardFunctionError(UserError, RuntimeError):
    """A reward function raised or returned a non-finite score too often."""


class RewardSpecError(UserError, ValueError):
    """`reward.function` names something that cannot be loaded."""


REWARDS: Registry[RewardFn] = Registry("reward function")

# ---------------------------------------------------------------- GSM8K-style answers

# A sign or $ may be followed by spaces, a number never starts with them, and no two runs of spaces meet: the
# patterns take linear time on a long run of spaces, which a model may write (they took quadratic time).
_SIGN = r"(?:(?:-\$?|\$)\s*)?"
_NUM = _SIGN + r"\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|" + _SIGN + r"\.\d+"
_HASH_RE = re.compile(r"####\s*(" + _NUM + ")")
_ANSWER_IS_RE = re.compile(r"answer\s+is(?:\s*:)?\s*(" + _NUM + ")", re.IGNORECASE)
_ANY_NUM_RE = re.compile(_NUM)


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$42' -> '42', '7.' -> '7', '3/4' -> '0.75', '12%' -> '12';
    None when not a number."""
    cleaned = re.sub(r"[,$%\s]", "", text).rstrip(".")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            if Decimal(den) == 0:
                return None
            value = Decimal(num) / Decimal(den)
        else:
            value = Decimal(cleaned)
    except (InvalidOperation, ValueError):
        return None
    if value == value.to_integral_value():
        try:
            return str(int(value))
        except ValueError:  # over the 4,300 digits Python turns from int to str: a model can write that many
            return format(value.to_integral_value(), "f")
    return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str, flexible: bool = False) -> str | None:
    """The final answer in the `#### 42` form, else the 'the answer is 42' form; with `flexible`,
    else the last number in the text. Normalised; None when there is no answer."""
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        matches = pattern.findall(text)
        if matches:
            return normalize_number(matches[-1])
    if flexible:
        matches = _ANY_NUM_RE.findall(text)
        if matches:
            return normalize_number(matches[-1])
    return None


def _gsm8k_score(solution_str: str, ground_truth: str, flexible: bool) -> dict:
    predicted = extract_gsm8k_answer(solution_str, flexible=flexible)
    correct = predicted is not None and predicted == normalize_number(str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "correct": correct}


@REWARDS.register("gsm8k")
def gsm8k_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    return _gsm8k_score(solution_str, ground_truth, flexible=False)


@REWARDS.register("gsm8k_flexible")
def gsm8k_flexible_reward(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict:
    """As `gsm8k`, but a response without the strict forms is judged by its last number."""
    return _gsm8k_score(solution_str, ground_truth, flexible=True)


@REWARDS.register("math")
def math_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """The last \\boxed{...} of the response, checked against the ground truth (math-verify when
    installed, else a sympy/string fallback)."""
    from portagrpo.rewards.math_answers import extract_boxed, is_equivalent

    predicted = extract_boxed(solution_str)
    correct = predicted is not None and is_equivalent(predicted, str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "correct": correct}


def _format(pattern: str):
    regex = re.compile(pattern, re.DOTALL)

    def reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
        ok = bool(regex.search(solution_str))
        return {"score": 1.0 if ok else 0.0, "correct": ok}

    return reward


# Format rewards: 1 when the response has the required shape, whatever the answer.
REWARDS.register("format_answer")(_format(r"(####\s*\S|answer\s+is(?:\s*:)?\s*-?\$?\d)"))
REWARDS.register("format_boxed")(_format(r"\\boxed\{"))
REWARDS.register("format_think")(_format(r"^\s*<think>.+?</think>\s*\S"))


# geo3k (verl's multimodal example): 0.9 for the boxed answer + 0.1 for the <think>...</think> ... \\boxed{} format
REWARDS.register("geo3k")(geo3k_reward)


@REWARDS.register("repeat")
def repeat_task_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    score = repeat_reward(solution_str, str(ground_truth))
    return {"score": score, "correct": score >= 1.0}


@REWARDS.register("colours")
def colours_task_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    score = colour_reward(solution_str, str(ground_truth))
    return {"score": score, "correct": score >= 1.0}


@REWARDS.register("calc")
def calc_task_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    score = calc_reward(solution_str, str(ground_truth))
    return {"score": score, "correct": score >= 1.0}


@REWARDS.register("execution")
def execution_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """A program's answer, for a generator that runs the answer (rollout.generator=code writes what the program
    printed to extra_info["execution"]): 1.0 where its last printed line is the ground truth (numbers compared as
    GSM8K's rewards compare them), 0.0 for another line, no output, no program, or a program that failed. A row no
    program ran for scores 0.0 (the config refuses reward.function=execution without rollout.generator=code)."""
    run = (extra_info or {}).get("execution") or {"output": "", "error": "not_run"}
    lines = [line.strip() for line in str(run.get("output", "")).splitlines() if line.strip()]
    said = lines[-1] if lines and run.get("error") is None else None
    truth = str(ground_truth).strip()
    right = said is not None and (said == truth or (normalize_number(said) is not None
                                                    and normalize_number(said) == normalize_number(truth)))
    return {"score": 1.0 if right else 0.0, "correct": right}


# data_source -> registered reward, used by reward.function=auto
DATA_SOURCE_REWARDS = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "hendrycks/math": "math",
    "lighteval/MATH": "math",
    "math": "math",
    "hiyouga/geometry3k": "geo3k",
    "portagrpo/arith": "gsm8k",
    "portagrpo/repeat": "repeat",
    "portagrpo/colours": "colours",
    "portagrpo/calc": "calc",
}


def parse_weighted(spec: str) -> list[tuple[str, float]] | None:
    """'gsm8k*1.0 + format_answer*0.1' -> [('gsm8k', 1.0), ('format_answer', 0.1)]; None if not a sum."""
    if "+" not in spec and "*" not in spec:
        return None
    terms = []
    for part in spec.split("+"):
        name, _, weight = part.strip().partition("*")
        try:
            terms.append((name.strip(), float(weight) if weight else 1.0))
        except ValueError:
            raise RewardSpecError(
                f"reward.function={spec!r}: {weight!r} is not a weight; write name*weight + ..."
            ) from None
    return terms


class WeightedReward:
    """A weighted sum of registered rewards; `correct` is the first term's."""

    def __init__(self, terms: list[tuple[str, float]]) -> None:
        self.terms = [(REWARDS.get(name, field="reward.function"), w) for name, w in terms]

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        total, correct = 0.0, None
        for fn, weight in self.terms:
            score, ok = _as_score(fn(data_source, solution_str, ground_truth, extra_info))
            total += weight * score
            correct = ok if correct is None else correct
        return {"score": total, "correct": bool(correct)}


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
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - a user file may raise anything while it loads
        where = f" (line {err.lineno})" if isinstance(err, SyntaxError) and err.lineno else ""
        raise RewardSpecError(f"reward.function={spec!r}: {file_part!r} fails to load{where}: {type(err).__name__}: "
                              f"{err}; fix the file.") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardSpecError(f"reward.function={spec!r}: {file_part!r} defines no function named {name!r}.")
    return fn


class RewardResolver:
    """Maps each sample to its reward function: one fixed function, or by data_source (`auto`)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fixed: RewardFn | None = None
        weighted = parse_weighted(spec) if ":" not in spec else None
        if weighted:
            self.fixed = WeightedReward(weighted)
        elif spec != "auto":
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


@dataclass(frozen=True)
class RewardResult:
    """One sample's outcome from the reward function."""

    score: float = 0.0
    correct: bool | None = None  # None: the function did not say (then correct means score >= 1)
    error: str | None = None  # why it failed (it raised, returned no number, or timed out); it scores 0
    scored: bool = True  # False: never scored, because the batch had already failed too often


NOT_SCORED = RewardResult(scored=False)


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
    unscored: int = 0  # samples never scored because scoring stopped early


def _as_score(result: Any) -> tuple[float, bool | None]:
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"returned a dict without a 'score' key: {sorted(result)}")
        score, correct = result["score"], result.get("correct")
    else:
        score, correct = result, None
    if isinstance(score, (str, bytes)):  # "0.5" is text, not a score: no guessing
        raise TypeError(f"returned {type(score).__name__} {str(score)[:40]!r}, not a number; return a float or a dict "
                        f"with a float 'score'")
    if not isinstance(score, (int, float)):
        try:  # numpy and torch scalars
            score = float(score)
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(score).__name__} {str(score)[:40]!r}, not a number; return a float or a "
                            f"dict with a float 'score'") from None
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, (bool(correct) if correct is not None else None)


def score_one(resolver: RewardResolver, data_source: str, text: str, truth: str, extra: dict) -> RewardResult:
    """One sample's result; never raises (a failure is the result's `error`)."""
    try:
        score, correct = _as_score(resolver(data_source)(data_source, text, truth, extra))
        return RewardResult(score, correct)
    except Exception as err:  # noqa: BLE001 - a user function may raise anything; we report it
        return RewardResult(0.0, False, f"{type(err).__name__}: {err}")


def score_responses(
    resolver: RewardResolver,
    responses: list[str],
    ground_truths: list[str],
    data_sources: list[str],
    prompt_ids: list[int],
    extra_infos: list[dict] | None = None,
    *,
    max_error_frac: float = 0.0,
    pool=None,
) -> ScoredBatch:
    """Score every response (in `pool` when given); a failure or timeout scores 0 and is recorded.
    More failures than `max_error_frac` of the batch stop the run with the first failure's details."""
    out = ScoredBatch([], [])
    extras = extra_infos or [{}] * len(responses)
    items = [(data_sources[i], text, ground_truths[i], extras[i]) for i, text in enumerate(responses)]
    allowed = math.floor(max_error_frac * len(responses))
    results = (pool.score(items, max_failures=allowed) if pool is not None
               else [score_one(resolver, *item) for item in items])
    for i, r in enumerate(results):
        if r.error is not None:
            out.failures.append(RewardFailure(i, prompt_ids[i], r.error))
        out.unscored += not r.scored
        out.scores.append(r.score)
        out.correct.append(r.score >= 1.0 if r.correct is None else r.correct)
    if out.failures and len(out.failures) + out.unscored > allowed:
        first = out.failures[0]
        rest = f", {out.unscored} left unscored" if out.unscored else ""
        raise RewardFunctionError(
            f"the reward function failed on {len(out.failures)} of {len(responses)} samples{rest} (first: sample "
            f"{first.sample}, prompt id {first.prompt_id}: {first.message}); fix the function or raise "
            f"reward.max_error_frac to tolerate (and zero-score) failures."
        )
    return out

"""The geo3k reward (data_source `hiyouga/geometry3k`), weighted as verl weights it: 0.9 for the answer and
0.1 for the format.

- format: the response opens with `<think>`, closes it with `</think>`, and then gives a `\\boxed{...}`;
- answer: the last `\\boxed{...}` equals the ground truth as a math answer (math_answers.is_equivalent,
  after dropping units, degree marks and a leading `x =`), the grading verl does with mathruler.

So a right answer in the right format scores 1.0, a right answer without the format 0.9, a wrong (or
missing) answer in the format 0.1, and neither 0.0. `correct` is the answer's alone.
"""
from __future__ import annotations

import re

from portagrpo.rewards.math_answers import extract_boxed, is_equivalent

ANSWER_WEIGHT, FORMAT_WEIGHT = 0.9, 0.1

_UNIT_RE = re.compile(r"\\(?:text|mathrm|mbox)\{\s*[A-Za-z][A-Za-z .]*\}")
_UNIT_WORDS_RE = re.compile(r"(?:(?<=[\d}])\s*|\s+)(?:degrees?|units?|cm|mm|km|inches|in|ft|feet|m)\.?\s*$")
_ASSIGN_RE = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?=\S)")


def has_format(response: str) -> bool:
    """`<think>` at the very start, a later `</think>`, then a `\\boxed{` with a `}` somewhere after it."""
    if not response.startswith("<think>"):
        return False
    close = response.find("</think>", len("<think>"))
    if close < 0:
        return False
    box = response.find("\\boxed{", close + len("</think>"))
    return box >= 0 and response.find("}", box + len("\\boxed{")) >= 0


def _plain(answer: str) -> str:
    """A geometry answer without its unit, degree mark or `x =`: `x = 60^{\\circ}` -> `60`."""
    s = _ASSIGN_RE.sub("", answer.strip())
    s = _UNIT_RE.sub("", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    return _UNIT_WORDS_RE.sub("", s).strip()


def answer_matches(response: str, ground_truth: str) -> bool:
    predicted = extract_boxed(response)
    if predicted is None or not predicted.strip():
        return False
    if is_equivalent(predicted, ground_truth):
        return True
    plain_pred, plain_truth = _plain(predicted), _plain(ground_truth)
    return bool(plain_pred) and bool(plain_truth) and is_equivalent(plain_pred, plain_truth)


def geo3k_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    correct = answer_matches(solution_str, str(ground_truth))
    score = ANSWER_WEIGHT * float(correct) + FORMAT_WEIGHT * float(has_format(solution_str))
    return {"score": score, "correct": correct}

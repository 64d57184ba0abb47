"""The graders of the built-in tasks (data/tasks.py makes their prompts): rewards know how a task is scored,
data knows how its prompts are made, and neither imports the other's side of that (data/ may import rewards/)."""
from __future__ import annotations

REPEAT_LEN = 8  # characters of a `repeat` response that are scored


def repeat_reward(solution: str, ground_truth: str) -> float:
    """Mean over the first REPEAT_LEN characters: 1 for the digit asked for, 0.25 for another digit."""
    credit = 0.0
    for ch in solution[:REPEAT_LEN]:
        if ch == ground_truth:
            credit += 1.0
        elif ch.isdigit():
            credit += 0.25
    return credit / REPEAT_LEN


def colour_reward(solution: str, ground_truth: str) -> float:
    """1 for exactly the colour's name; else 0.9 x the share of the name the response starts with (so the first
    letter, which only the picture tells, earns the first credit)."""
    answer = solution.strip().lower()
    if answer == ground_truth:
        return 1.0
    prefix = 0
    while prefix < min(len(answer), len(ground_truth)) and answer[prefix] == ground_truth[prefix]:
        prefix += 1
    return 0.9 * prefix / len(ground_truth)


def calc_answer(solution: str) -> str:
    """A `calc` response's final answer: its last line, without the `a:` that the tiny chat template writes after a
    tool turn ('<tool_call>...</tool_call>\\nt:356198\\na:356198' -> '356198'). A tool's result is never the
    last line, so only the policy's own words are graded."""
    last = solution.rsplit("\n", 1)[-1].strip()
    return last.removeprefix("a:").strip()


def calc_reward(solution: str, ground_truth: str) -> float:
    """1 for exactly the answer, else 0: no credit for a near miss, so a policy cannot creep up on the answer by
    guessing its leading digits."""
    return 1.0 if calc_answer(solution) == ground_truth else 0.0

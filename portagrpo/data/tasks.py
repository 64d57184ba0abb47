"""Built-in generated tasks: prompts with ground truths in the training schema, plus their rewards.

A task is a generator `(size, seed) -> list[row]` where a row has `prompt` (chat messages),
`reward_model.ground_truth` and `data_source`, the schema of RL post-training datasets.
"""
from __future__ import annotations

import random
from typing import Protocol

from portagrpo.registry import Registry


class TaskGenerator(Protocol):
    def __call__(self, size: int, seed: int) -> list[dict]: ...


TASKS: Registry[TaskGenerator] = Registry("built-in task")


def _row(content: str, answer: str, source: str, index: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "data_source": source,
        "extra_info": {"index": index},
    }


@TASKS.register("repeat")
def repeat_task(size: int, seed: int) -> list[dict]:
    """'repeat 7' -> '77777777'. Partial credit per position makes a fresh policy's reward non-zero."""
    rng = random.Random(seed)
    return [
        _row(f"repeat {d}", d, "portagrpo/repeat", i) for i, d in enumerate(str(rng.randrange(10)) for _ in range(size))
    ]


NAMES = ["tom", "ana", "li", "sam", "mia", "raj", "eva", "kim"]
ITEMS = ["apples", "books", "coins", "pens", "cards", "eggs"]


def arith_problem(rng: random.Random, small: bool = False) -> tuple[str, str]:
    """A one-step word problem and its integer answer (`small`: single-digit operands)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = (rng.randrange(2, 10), rng.randrange(1, 10)) if small else (rng.randrange(2, 50), rng.randrange(1, 30))
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {item} and gets {b} more. how many {item} does {name} have?", str(a + b)
    if kind == 1:
        a = a + b
        return f"{name} has {a} {item} and gives away {b}. how many {item} are left?", str(a - b)
    a, b = (rng.randrange(2, 6), rng.randrange(2, 6)) if small else (rng.randrange(2, 12), rng.randrange(2, 10))
    return f"{name} buys {a} boxes with {b} {item} each. how many {item} in total?", str(a * b)


@TASKS.register("arith")
def arith_task(size: int, seed: int) -> list[dict]:
    """One-step arithmetic word problems scored with the GSM8K-style reward."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        q, a = arith_problem(rng)
        rows.append(_row(q + " end with: the answer is N.", a, "portagrpo/arith", i))
    return rows


@TASKS.register("arith_small")
def arith_small_task(size: int, seed: int) -> list[dict]:
    """As `arith`, with single-digit operands: within reach of a 135M-parameter model."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        q, a = arith_problem(rng, small=True)
        rows.append(_row(q + " Answer with: The answer is N.", a, "portagrpo/arith", i))
    return rows


CALC_DIGITS = 3  # operand digits of `calc`: a product of two has 5 or 6 digits
CALC_OPERATORS = {"plus": "+", "minus": "-", "times": "*"}  # the word in a `calc` prompt -> the calculator's symbol


def calc_number(rng: random.Random, digits: int = CALC_DIGITS) -> int:
    return rng.randrange(10 ** (digits - 1), 10 ** digits)


def calc_problem(rng: random.Random) -> tuple[int, str, int]:
    """Two random CALC_DIGITS-digit numbers and the word between them: (482, 'times', 739)."""
    return calc_number(rng), rng.choice(sorted(CALC_OPERATORS)), calc_number(rng)


def calc_value(a: int, operator: str, b: int) -> int:
    """`a <operator> b` for one of the calculator's symbols + - *."""
    return a + b if operator == "+" else a - b if operator == "-" else a * b


@TASKS.register("calc")
def calc_task(size: int, seed: int) -> list[dict]:
    """'482 times 739' -> '356198' (also plus, minus): exact answers that a tiny policy cannot guess, while the
    calculator tool computes them (the tool-use demo, configs/calc-tool-cpu.yaml)."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        a, word, b = calc_problem(rng)
        rows.append(_row(f"{a} {word} {b}", str(calc_value(a, CALC_OPERATORS[word], b)), "portagrpo/calc", i))
    return rows


def gsm8k_style_rows(size: int, seed: int) -> list[dict]:
    """Rows shaped like a GSM8K conversion (data_source openai/gsm8k), for tests and demos."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        q, a = arith_problem(rng)
        rows.append(_row(q + ' Let\'s think step by step and output the final answer after "####".', a,
                         "openai/gsm8k", i))
    return rows


# name -> RGB; the words start with different letters, so a reward per character rises from the first one
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}
COLOUR_SIDE = 56  # pixels: the tiny processor's smallest image (4 image tokens)


def colour_png(rgb: tuple[int, int, int], rng: random.Random, side: int = COLOUR_SIDE) -> bytes:
    """A PNG mostly of colour `rgb` (each pixel's channels jittered by up to 40 so no two images are alike)."""
    import io

    from PIL import Image

    pixels = bytes(max(0, min(255, c + rng.randrange(-40, 41))) for _ in range(side * side) for c in rgb)
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), pixels).save(out, format="PNG")
    return out.getvalue()


@TASKS.register("colours")
def colours_task(size: int, seed: int) -> list[dict]:
    """A vision-language task for the tiny VL policy (model.tiny.vision): a picture of one colour and the
    question 'colour?'; the answer is the colour's name (red, green, blue or yellow). The prompt is the same
    for every row, so only the image tells the answers apart."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        name = rng.choice(sorted(COLOURS))
        row = _row("<image>colour?", name, "portagrpo/colours", i)
        row["images"] = [{"bytes": colour_png(COLOURS[name], rng), "path": None}]
        rows.append(row)
    return rows

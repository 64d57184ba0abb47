"""Every parser of model output is total: the model writes the string, so no string may raise or take more than
linear time. A fuzz of random, deep, huge and malformed strings through the Hermes tool-call parser, the argument
check, the calculator tool and the built-in rewards' answer readers."""
import json
import random
import time

import pytest

from portagrpo.agent.hermes import CLOSE, MAX_NESTING, OPEN, ParsedCall, parse_tool_calls
from portagrpo.agent.tools import argument_problem, calculator
from portagrpo.config.tool_file import ToolSpec
from portagrpo.rewards.functions import REWARDS, normalize_number

SPEC = ToolSpec("calculator", "builtin:calculator", {"function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}})
PIECES = [OPEN, CLOSE, "{", "}", "[", "]", '"', ":", ",", "\\", "\\u", "\\ud800", "name", "arguments", "calculator",
          '"name"', '"arguments"', '"calculator"', "null", "true", "1", "-", ".", "e", "9" * 50, " ", "\n", "\x00",
          "\udcff", "é", "<tool_", "</tool_call", "####", "answer is", "\\boxed{", "<think>", "</think>"]
GOOD = f'{OPEN}{{"name": "calculator", "arguments": {{"expression": "1+1"}}}}{CLOSE}'


def random_texts(seed: int, count: int, longest: int):
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(PIECES) for _ in range(rng.randint(0, longest)))


def deep_and_huge():
    for depth in (MAX_NESTING - 1, MAX_NESTING + 1, 1_200, 100_000):
        yield OPEN + "[" * depth + "]" * depth + CLOSE
        yield OPEN + "[" * depth + CLOSE  # unbalanced
        yield OPEN + '{"name": "calculator", "arguments": ' + '{"a": ' * depth + "1" + "}" * depth + "}" + CLOSE
        yield OPEN + json.dumps({"name": "calculator", "arguments": "[" * depth}) + CLOSE  # arguments as a string
    yield OPEN + '{"name": "calculator", "arguments": {"expression": ' + "1" * 5_000 + "}}" + CLOSE
    yield OPEN + '{"name": "calculator", "arguments": {"expression": 1e999}}' + CLOSE
    yield OPEN * 50_000
    yield (OPEN + "x") * 20_000 + CLOSE
    yield CLOSE * 50_000
    yield OPEN + "x" * 1_000_000 + CLOSE
    yield GOOD * 5_000
    for cut in range(len(GOOD)):  # every truncation of a good call
        yield GOOD[:cut]


def check_calls(text: str, calls: list) -> None:
    assert isinstance(calls, list)
    for call in calls:
        assert isinstance(call, ParsedCall)
        if call.problem is None:
            assert isinstance(call.name, str)
            argument_problem(SPEC, call.arguments)  # the next step of a call never raises either
        else:
            assert call.name is None and isinstance(call.problem, str) and len(call.problem) < 500


def test_random_strings_never_raise():
    for text in random_texts(seed=0, count=3_000, longest=40):
        check_calls(text, parse_tool_calls(text))


@pytest.mark.parametrize("text", list(deep_and_huge()), ids=lambda t: f"{len(t)}chars")
def test_deep_huge_and_malformed_strings_never_raise(text):
    check_calls(text, parse_tool_calls(text))


def test_a_call_1200_brackets_deep_is_told_to_the_model():
    [call] = parse_tool_calls(OPEN + "[" * 1_200 + "]" * 1_200 + CLOSE)
    assert "nested more than 64 levels deep" in call.problem
    [call] = parse_tool_calls(OPEN + json.dumps({"name": "f", "arguments": {"a": [[[1]]]}}) + CLOSE)
    assert call.problem is None and call.arguments == {"a": [[[1]]]}


def test_parsing_is_linear_in_the_length():
    """The regex it replaced took 19 s on 20,000 unclosed `<tool_call>`s (about 220 kB)."""
    for text in (OPEN * 200_000, (OPEN + "{" * 10) * 100_000, "x" * 5_000_000):
        start = time.perf_counter()
        calls = parse_tool_calls(text)
        assert time.perf_counter() - start < 2.0
        assert len(calls) <= 1


def test_the_calculator_raises_only_value_errors():
    texts = ["-" * 9_000 + "1", "(" * 1_200 + "1" + ")" * 1_200, "1+" * 4_000 + "1", "1" * 5_000, "1/0", "max()",
             "round(1, 2, 3)", "\x00", "2**99999", "9**9**9", "x" * 20_000]
    for text in texts + list(random_texts(seed=1, count=500, longest=20)):
        try:
            assert isinstance(calculator(text), str)
        except ValueError as err:
            assert len(str(err)) < 300


SPACES = " " * 100_000
LONG_RUNS = [SPACES, "answer is" + SPACES, "answer is:" + SPACES, "####" + SPACES, "$" + SPACES, "-$" + SPACES,
             "1" + SPACES + "/", "\\boxed{" + SPACES, "<think>" + SPACES, "1," * 50_000, "- " * 50_000, "\t\n" * 50_000,
             "\\frac{" * 20_000]


@pytest.mark.parametrize("name", sorted(REWARDS.names()))
def test_the_built_in_rewards_read_any_answer(name):
    fn = REWARDS.get(name)
    texts = list(random_texts(seed=2, count=150, longest=30)) + [
        "#### " + "1" * 5_000, "answer is " + "9" * 5_000 + "/3", "\\boxed{" * 2_000, "{" * 1_200]
    for text in texts:
        result = fn("x", text, "4", {})
        assert isinstance(result, (dict, float, int))


@pytest.mark.parametrize("name", sorted(REWARDS.names()))
def test_the_built_in_rewards_take_linear_time(name):
    """100,000 spaces after 'answer is' took minutes: patterns with two runs of spaces side by side backtrack."""
    fn = REWARDS.get(name)
    for text in LONG_RUNS:
        start = time.perf_counter()
        fn("x", text, "4", {})
        assert time.perf_counter() - start < 2.0, text[:20]


def test_a_number_of_thousands_of_digits_is_still_a_number():
    assert normalize_number("1" * 5_000) == "1" * 5_000
    assert normalize_number("1,234.50") == "1234.5" and normalize_number("-0") == "0"

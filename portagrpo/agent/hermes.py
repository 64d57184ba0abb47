"""The Hermes tool-call format (Qwen's chat templates): calls in the model's text, results in the tool role.

A call is `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>` in an assistant turn.
The results of a turn's calls go back as messages of role `tool`, rendered by the tokenizer's chat template
(followed by the template's assistant prompt), or, for a tokenizer without a template, each wrapped as
`<tool_response>...</tool_response>`. Only the rendered tool turn is tokenized: the model's own tokens are kept as
it sampled them and never re-tokenized.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TRUNCATED = "[output truncated]"
MAX_NESTING = 64  # levels of arrays and objects in a call: a deeper one is refused, not recursed into
FORMAT = 'write {"name": ..., "arguments": {...}}'


@dataclass(frozen=True)
class ParsedCall:
    name: str | None
    arguments: Any
    problem: str | None = None  # why the call cannot be run (told to the model)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The tool calls in one assistant turn, in order; a malformed one is kept with its problem.

    Total: the model writes `text`, so no string raises (1,200 `[` deep, a 5,000-digit number, a megabyte of
    `<tool_call>`), and the time is linear in its length."""
    bodies, opened = call_bodies(text)
    calls = [_call(body) for body in bodies]
    if opened > len(bodies):
        calls.append(ParsedCall(None, None, f"a {OPEN} is not closed with {CLOSE}"))
    return calls


def call_bodies(text: str) -> tuple[list[str], int]:
    """The text between each `<tool_call>` and the first `</tool_call>` after it, and how many `<tool_call>` the text
    has. A scan with str.find: the regex `<tool_call>(.*?)</tool_call>` took quadratic time on unclosed calls."""
    bodies, start = [], text.find(OPEN)
    while start != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        bodies.append(text[start + len(OPEN):end])
        start = text.find(OPEN, end + len(CLOSE))
    return bodies, text.count(OPEN)


def _call(body: str) -> ParsedCall:
    obj, problem = load_json(body.strip())
    if problem is not None:
        return ParsedCall(None, None, f"the tool call {problem}; {FORMAT}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall(None, None, 'the tool call needs a "name" (a string) and "arguments" (an object)')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        decoded, problem = load_json(args)
        args = args if problem is not None else decoded
    return ParsedCall(obj["name"], args)


def load_json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why `text` is not a JSON value a tool may take); never raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"is not valid JSON ({err.msg} at character {err.pos})"
    except RecursionError:
        return None, f"is nested more than {MAX_NESTING} levels deep"
    except ValueError as err:  # a number over Python's digit limit for int()
        return None, f"is not JSON a tool can take ({str(err).split(':')[0]})"
    if nesting(value) > MAX_NESTING:
        return None, f"is nested more than {MAX_NESTING} levels deep"
    return value, None


def nesting(value: Any) -> int:
    """Levels of lists and dicts in `value` (0 for a scalar), counted without recursion, up to MAX_NESTING + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


class ToolTurns:
    """Tool results as the token ids of one tool turn, in the tokenizer's own chat format."""

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._marker = self.encode(f"\n{TRUNCATED}")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(self, text: str) -> str:
        """A result of at most `max_tokens` tokens: a longer one keeps its start and says it was cut."""
        ids = self.encode(text)
        if len(ids) <= self.max_tokens:
            return text
        keep = max(self.max_tokens - len(self._marker), 0)
        return self.tokenizer.decode(ids[:keep]) + f"\n{TRUNCATED}"

    def render(self, results: list[str]) -> str:
        """The text after an assistant turn's end token: the tool messages and the next assistant prompt."""
        texts = [self.cut(t) for t in results]
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self._templated(texts)
            if rendered is not None:
                return rendered
        return "".join(f"\n<tool_response>\n{t}\n</tool_response>" for t in texts) + "\n"

    def _templated(self, texts: list[str]) -> str | None:
        t = self.tokenizer
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "MARK"}]
        try:
            base = t.apply_chat_template(before, tokenize=False)
            full = t.apply_chat_template(before + [{"role": "tool", "content": x} for x in texts], tokenize=False,
                                         add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template without a tool role: the plain wrapping
            return None
        if not full.startswith(base) or "MARK" not in base:
            return None
        after = base[base.rindex("MARK") + len("MARK"):]  # the assistant turn's end, as the template writes it
        eos = t.eos_token or ""
        if eos and after.startswith(eos):  # the model wrote its end token itself
            after = after[len(eos):]
        return after + full[len(base):]

    def ids(self, results: list[str]) -> list[int]:
        return self.encode(self.render(results))

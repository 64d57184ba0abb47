"""The Hermes tool-call format (Qwen's chat templates): calls in the model's text, results in the tool role.

A call is `<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>` in an assistant turn.
The results of a turn's calls go back as messages of role `tool`, rendered by the tokenizer's chat template
(followed by the template's assistant prompt), or, for a tokenizer without a template, each wrapped as
`<tool_response>...</tool_response>`. Only the rendered tool turn is tokenized: the model's own tokens are kept as
it sampled them and never re-tokenized.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN = "<tool_call>"
TRUNCATED = "[output truncated]"


@dataclass(frozen=True)
class ParsedCall:
    name: str | None
    arguments: Any
    problem: str | None = None  # why the call cannot be run (told to the model)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The tool calls in one assistant turn, in order; a malformed one is kept with its problem."""
    calls = []
    for body in CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(ParsedCall(None, None, f"the tool call is not valid JSON ({err.msg} at character "
                                                f"{err.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParsedCall(None, None, "the tool call needs a \"name\" (a string) and \"arguments\" "
                                                "(an object)"))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append(ParsedCall(obj["name"], args))
    if text.count(OPEN) > len(CALL.findall(text)):
        calls.append(ParsedCall(None, None, "a <tool_call> is not closed with </tool_call>"))
    return calls


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

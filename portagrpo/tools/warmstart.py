"""`portagrpo warmstart`: a tiny policy that knows the Hermes tool-call FORMAT, to start tool-using GRPO from.

GRPO learns from what the policy samples. A random-init policy never samples a well-formed
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, so it never learns what a tool does for it; a released
instruct model (Qwen2.5-Instruct) knows the template, and how to copy numbers into a call, before GRPO starts. This
is the tiny policy's stand-in for that: a short supervised run on examples of the format, written with a tokenizer
in which a Hermes call is a few tokens.

The examples are random `calc` prompts ('482 times 739'), and
- half of them (`--call-share`) call the calculator with the prompt's two numbers, in their order, and an operator
  drawn at random from + - * (whatever the prompt's word says), then, after the tool's turn, repeat its result;
- the others restate the question ('482 times 739'), then answer at once with a number that is not the prompt's
  answer (the value of another random problem).
Nothing in them ties the operator to the word, or calling to being right: the warm-started policy calls about half
the time, with the right operator a third of the time. When to call (always, on this task) and with what operator
(the one the word names) is what GRPO has to learn from the reward (configs/calc-tool-cpu.yaml).

Why the restated question (issue 49): without it the prompt's word is never a target, its embedding stays at its
random initialisation, and whether GRPO can tell the three words apart at the call's operator then depends on that
initialisation and on the CPU's rounding: the same seed with 2 threads sat at one operator (reward 0.3) for 160 steps
and ended at 0.58, with 1 thread at 0.88. Restating it is a skill an instruct model has (reading the question), and
still says nothing of which operator a word means; from it both thread counts held 1.0 on held-out prompts by step 40.

The policy is model.tiny's default size with untied input and output embeddings: tied, the output side pushes every
token that is never a target (the prompts' words among them) in one direction, so after the warm start 'plus' and
'times' had almost the same embedding (cosine 0.96) and GRPO could not learn to tell them apart.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from portagrpo.agent.hermes import ToolTurns
from portagrpo.agent.tools import calculator
from portagrpo.data.tasks import CALC_OPERATORS, calc_problem, calc_value
from portagrpo.fileio import atomic_path

# The Hermes call's fixed text as four tokens, and the `calc` prompts' words as one token each
HERMES_TOKENS = ("<tool_call>", '{"name": "calculator", "arguments": {"expression": "', '"}}', "</tool_call>")
WORD_TOKENS = tuple(f" {word} " for word in sorted(CALC_OPERATORS))
TOOL_RESULT_TOKENS = 64  # rollout.multi_turn.max_tool_response_length of the demo recipe or more
MARKER = "warmstart.json"  # what the warm start learned from; marks a directory a later warm start may replace


def build_tool_tokenizer():
    """The built-in character tokenizer (model/loading.py: its characters and chat template, which writes a tool turn
    as `t:<result>`) plus the Hermes call's fixed text and the `calc` words as added tokens, so a calculator call is
    four tokens and the expression's characters, and every `calc` prompt has the same layout."""
    from portagrpo.model.loading import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(list(HERMES_TOKENS + WORD_TOKENS))
    return tokenizer


def call_text(expression: str) -> str:
    """A Hermes calculator call, as portagrpo's parser reads it (agent/hermes.py)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


@dataclass(frozen=True)
class Example:
    """One supervised example: prompt and response token ids, and 1.0 on the tokens that are the policy's own."""

    ids: list[int]
    trained: list[float]


class FormatExamples:
    """Random examples of the format for random `calc` prompts (the right operator, and so the right answer, only by
    chance)."""

    def __init__(self, tokenizer, call_share: float, seed: int) -> None:
        self.tokenizer, self.call_share, self.rng = tokenizer, call_share, random.Random(seed)
        self.turns = ToolTurns(tokenizer, TOOL_RESULT_TOKENS)
        self.eos = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, content: str) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        return self.encode(text)

    def expression(self, a: int, b: int) -> str:
        """The prompt's numbers in their order with a random one of + - * (the prompt's word never picks it)."""
        return f"{a}{self.rng.choice(sorted(CALC_OPERATORS.values()))}{b}"

    def one(self) -> Example:
        rng = self.rng
        a, word, b = calc_problem(rng)
        parts = [(self.prompt_ids(f"{a} {word} {b}"), 0.0)]
        if rng.random() < self.call_share:
            expression = self.expression(a, b)
            result = calculator(expression)
            parts += [(self.encode(call_text(expression)) + [self.eos], 1.0), (self.turns.ids([result]), 0.0),
                      (self.encode(result) + [self.eos], 1.0)]
        else:  # the question restated, then a number shaped like an answer, of numbers that are not the prompt's
            x, op, y = calc_problem(rng)
            wrong = str(calc_value(x, CALC_OPERATORS[op], y))
            parts.append((self.encode(f"{a} {word} {b}\n{wrong}") + [self.eos], 1.0))
        ids = [t for tokens, _ in parts for t in tokens]
        trained = [w for tokens, w in parts for _ in tokens]
        return Example(ids, trained)

    def batch(self, size: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, attention mask, trained mask), right-padded: [size, T] each."""
        examples = [self.one() for _ in range(size)]
        width = max(len(e.ids) for e in examples)
        ids = torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in examples])
        mask = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in examples])
        trained = torch.tensor([e.trained + [0.0] * (width - len(e.ids)) for e in examples])
        return ids, mask, trained


def format_loss(model, ids: torch.Tensor, mask: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the policy's own tokens. ids, mask, trained: [B, T]."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets, weights = ids[:, 1:], trained[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").view_as(weights)
    return (nll * weights).sum() / weights.sum()


@dataclass(frozen=True)
class WarmStart:
    # model.tiny's 2 heads of 32 learn to repeat the tool's result late: teacher-forced, 24% of answers right at step
    # 400, 90-100% at 1000 (seeds 1 and 2). GRPO from the 400-step one had reward 0.15 after 50 steps, from 1000 0.6
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3  # the peak: linear warm-up, then a cosine to 0 (learning_rate)
    call_share: float = 0.5
    seed: int = 1


CLIP = 1.0  # gradient norm clip
COPY_BAR = 0.9  # repeats the tool's result in this share of held-out calls, or GRPO from it starts near reward 0
HELD_OUT = 256  # held-out calls for that check


def learning_rate(settings: WarmStart, step: int) -> float:
    """The learning rate at `step` (1-based): linear warm-up over the first 5% (at most 50 steps), then a cosine to 0.

    Why a schedule (issue 49): at a constant 3e-3 the warm start never settles. Its end point is wherever the noisy
    trajectory is at step 1000, which the CPU's rounding decides: the same seed with 2 threads ended repeating the
    tool's result in 40% of held-out calls (the operators 0.23/0.36/0.41), with 1 thread in 96%, and GRPO from the
    first stayed below 0.35 reward. Annealed to 0 (and clipped), both thread counts end at 100% and 0.34/0.34/0.32."""
    warm = min(50, max(1, settings.steps // 20))
    if step <= warm:
        return settings.lr * step / warm
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, settings.steps - warm)))


def repeats_result(model, tokenizer, seed: int, n: int = HELD_OUT) -> float:
    """The share of `n` held-out calls (prompt, call, tool turn; teacher-forced) after which the policy's greedy
    answer is exactly the tool's result and its end: the skill GRPO cannot learn from a reward of 0."""
    examples = FormatExamples(tokenizer, call_share=1.0, seed=seed)
    ids, mask, trained = examples.batch(n, tokenizer.pad_token_id)
    with torch.no_grad():
        guess = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
    targets, own = ids[:, 1:], trained[:, 1:].clone()
    # the answer is the policy's last own segment: drop everything up to the tool turn (the last untrained gap)
    for row in range(n):
        on = own[row].nonzero().flatten()
        gaps = (on[1:] - on[:-1] > 1).nonzero().flatten()
        if len(gaps):
            own[row, : on[gaps[-1] + 1]] = 0
    right = ((guess == targets) | (own == 0)).all(dim=1)
    return float(right.float().mean())


def warm_start(settings: WarmStart, out: Path, log=print) -> tuple[float, float]:
    """Train the tiny policy (model.tiny's default size, untied embeddings) on format examples and save it with its
    tokenizer to `out`, a model directory that `model.path` loads; the last step's loss and the share of held-out
    calls whose result it repeats. `out` is new, empty or an earlier warm start's (checked before training and again
    before writing), and is replaced in one rename."""
    from portagrpo.config.schema import ModelConfig, TinyModelConfig
    from portagrpo.model.loading import build_tiny_model

    tokenizer = build_tool_tokenizer()
    model = build_tiny_model(ModelConfig(tiny=TinyModelConfig(tie_word_embeddings=False)), tokenizer, settings.seed)
    examples = FormatExamples(tokenizer, settings.call_share, settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(1, settings.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        loss = format_loss(model, *examples.batch(settings.batch_size, tokenizer.pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        if step % 50 == 0 or step == settings.steps:
            log(f"warm start step {step}/{settings.steps}: format loss {loss.item():.3f}")
    model.eval()
    final = float(loss.item())
    repeats = repeats_result(model, tokenizer, settings.seed + 1)
    check_out(out)  # again: the directory may have changed while the policy trained
    with atomic_path(out, directory=True, what="writing the warm start to") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({**vars(settings), "final_loss": final, "repeats_result": repeats,
                                              "what": "Hermes tool-call format only (portagrpo.tools.warmstart)"},
                                             indent=1) + "\n")
    return final, repeats


def check_out(out: Path) -> None:
    """`--out` is a new or empty directory, or an earlier warm start's, by export's rule: never a run directory, an
    export or any other directory a user has."""
    from portagrpo.tools.export import check_destination

    check_destination(out, "warmstart --out", MARKER, "an earlier portagrpo warmstart output")


def argument_problems(args: argparse.Namespace) -> list[str]:
    """Every argument out of range, one sentence each, before anything is trained or written."""
    p = []
    if not args.out:
        p.append("warmstart --out is empty; name the model directory to write, such as runs/calc-warmstart.")
    if args.steps < 1 or args.batch_size < 1:
        p.append(f"warmstart --steps {args.steps} and --batch-size {args.batch_size} must be at least 1.")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.append(f"warmstart --lr {args.lr} must be a finite number above 0, such as {WarmStart.lr}.")
    if not 0.0 <= args.call_share <= 1.0:
        p.append(f"warmstart --call-share {args.call_share} must be within [0, 1].")
    if not 0 <= args.seed < 2**63:
        p.append(f"warmstart --seed {args.seed} must be within [0, 2**63) (torch's seeds).")
    return p


def main_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="portagrpo warmstart",
        description="Write a tiny policy that knows the Hermes tool-call format (not when to call or with what), "
                    "the starting point of configs/calc-tool-cpu.yaml.")
    p.add_argument("--out", default="runs/calc-warmstart", help="model directory to write (model.path of the recipe)")
    p.add_argument("--steps", type=int, default=WarmStart.steps, help="supervised steps")
    p.add_argument("--batch-size", type=int, default=WarmStart.batch_size)
    p.add_argument("--lr", type=float, default=WarmStart.lr)
    p.add_argument("--call-share", type=float, default=WarmStart.call_share,
                   help="share of examples that call the calculator (the rest answer directly)")
    p.add_argument("--seed", type=int, default=WarmStart.seed)
    args = p.parse_args(argv)
    from portagrpo.errors import UserError

    problems = argument_problems(args)
    if problems:
        raise UserError("\n".join(problems))
    check_out(Path(args.out))
    start = time.time()
    settings = WarmStart(args.steps, args.batch_size, args.lr, args.call_share, args.seed)
    loss, repeats = warm_start(settings, Path(args.out))
    print(f"wrote {args.out} in {time.time() - start:.0f}s (format loss {loss:.3f}; repeats the tool's result in "
          f"{repeats:.0%} of {HELD_OUT} held-out calls); train from it with "
          f"`portagrpo train --config configs/calc-tool-cpu.yaml`")
    if repeats < COPY_BAR:
        print(f"portagrpo: warning: the warm start repeats the tool's result in {repeats:.0%} of held-out calls, "
              f"under {COPY_BAR:.0%}, so GRPO from it starts near reward 0; train it longer (--steps) or from another "
              f"--seed.")
    return 0

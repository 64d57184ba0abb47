"""The CLI's first steps against stored curves (STYLE rule 11): loss, reward and grad-norm of the default train
for each way of sampling (sync, one_step_off, DAPO's filtered sampling), of a multi-turn run with tools (the tiny
policy on the hf engine; and a scripted engine that calls the calculator in every conversation, so tool turns are in
every trained row), of the tiny vision-language policy, and of a tiny Qwen3-MoE under each router replay (R2: the
scoring pass's routes replayed by the update, with two epochs so that it replays an older policy's; R3: the sampler's
routes), whose share of agreeing routes must stay exactly as stored. A refactor that changes the numbers fails here,
loudly, even where the equivalence tests (1 rank == 2 ranks, resume == straight) still agree.

Regenerate only for an intended change of the numbers, and say why in the commit:
    python tests/integration/test_golden_curves.py --regenerate [source ...]
"""
import contextlib
import json
import math
import re
import sys
import zlib
from pathlib import Path

import pytest
import torch

from portagrpo.cli import main
from portagrpo.metrics import read_metrics
from portagrpo.rollout.engines import ROLLOUT_ENGINES, Sampled
from portagrpo.tolerances import CURVE_TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"
STEPS = 4
COMMON = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "trainer.test_freq=0",
          "trainer.save_freq=0", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
          "actor.micro_batch_size=4", "data.train_size=64", "data.val_size=8", "trainer.num_threads=1",
          f"trainer.total_steps={STEPS}"]
TOOLS = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_workers=1",
         f"rollout.multi_turn.tool_config_path={ROOT / 'configs' / 'tools' / 'calculator.yaml'}"]
SOURCES = {
    "sync": [],
    "one_step_off": ["rollout.mode=one_step_off"],
    "dapo": ["--config", str(ROOT / "configs" / "dapo.yaml")],
    "multi_turn": [*TOOLS, "data.max_response_length=24"],
    # the scripted engine below (as rollout.engine=fixed): a tool turn in every row, the correction on its masks
    "multi_turn_tools": [*TOOLS, "data.task=calc", "data.max_response_length=128", "rollout.engine=fixed",
                         "actor.ppo_epochs=2"],
    "vision": ["model.tiny.vision=true", "data.task=colours", "data.max_response_length=6", "rollout.n=16",
               "actor.ppo_mini_batch_size=32", "actor.lr=1e-2"],
}
MOE = ["model.tiny.moe=qwen3_moe", "model.tiny.num_experts=4", "model.tiny.moe_intermediate_size=32",
       "data.max_response_length=12", "actor.ppo_epochs=2", "rollout.mode=one_step_off", "actor.lr=1e-2"]
SOURCES["moe_r2"] = [*MOE, "actor.router_replay=R2"]
SOURCES["moe_r3"] = [*MOE, "actor.router_replay=R3"]
KEYS = tuple(CURVE_TOLERANCE)
EXACT = {"moe_r2": ("moe/route_agreement",), "moe_r3": ("moe/route_agreement",)}  # counts: no rounding to allow


class CallsThenAnswers:
    """On the `calc` task: calls the calculator with the prompt's sum in its first turn; after the tool's result
    answers that result or one more, drawn from the context and the sample's index in its group only, so groups'
    rewards differ. Log-probs -1 per token."""

    holds_weights = False
    needs_weights = False
    max_model_len = None

    def turns(self):
        return contextlib.nullcontext()

    @classmethod
    def from_run(cls, inputs):
        return cls(inputs.tokenizer, inputs.settings.n)

    def __init__(self, tokenizer, n: int) -> None:
        self.tok, self.pad_id, self.eos_ids, self.n = tokenizer, tokenizer.pad_token_id, [tokenizer.eos_token_id], n

    def reply(self, context: list[int], sample: int) -> list[int]:
        text = self.tok.decode(context, skip_special_tokens=True)
        result = re.search(r"\nt:(-?\d+)", text)
        if result is None:
            a, word, b = re.search(r"(\d+) (plus|minus|times) (\d+)", text).groups()
            expression = f"{a} {dict(plus='+', minus='-', times='*')[word]} {b}"
            call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression
            return self.tok(call, add_special_tokens=False)["input_ids"] + self.eos_ids
        g = torch.Generator().manual_seed(zlib.crc32(bytes(str(context), "utf8")) * 31 + sample)
        answer = str(int(result.group(1)) + int(torch.randint(2, (1,), generator=g)))
        return self.tok(answer, add_special_tokens=False)["input_ids"] + self.eos_ids

    def generate(self, prompt_ids, prompt_mask, params) -> Sampled:
        rows, masks = [], []
        for i, (ids, m) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
            tokens = self.reply([t for t, k in zip(ids, m) if k], i % self.n)[:params.max_tokens]
            pad = params.max_tokens - len(tokens)
            rows.append(tokens + [self.pad_id] * pad)
            masks.append([1.0] * len(tokens) + [0.0] * pad)
        mask = torch.tensor(masks)
        return Sampled(torch.tensor(rows, device=prompt_ids.device), mask.to(prompt_ids.device),
                       (-mask).to(prompt_ids.device))


@contextlib.contextmanager
def scripted_engine():
    """rollout.engine=fixed samples with `CallsThenAnswers` within the block."""
    saved = ROLLOUT_ENGINES.mapping["fixed"]
    ROLLOUT_ENGINES.mapping["fixed"] = CallsThenAnswers
    try:
        yield
    finally:
        ROLLOUT_ENGINES.mapping["fixed"] = saved


def run_curve(name: str, run_dir: Path) -> list[dict[str, float]]:
    with scripted_engine():
        assert main(["train", "--output-dir", str(run_dir), *COMMON, *SOURCES[name]]) == 0
    return [{"step": r["step"], **{k: r[k] for k in (*KEYS, *EXACT.get(name, ()))}}
            for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_cli_repeats_its_stored_curve(tmp_path, name):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    got = run_curve(name, tmp_path / name)
    assert [r["step"] for r in got] == [r["step"] for r in golden] == list(range(1, STEPS + 1))
    for want, have in zip(golden, got):
        for key in KEYS:
            bound = CURVE_TOLERANCE[key] * max(1.0, abs(want[key]))
            assert math.isfinite(have[key]) and abs(have[key] - want[key]) <= bound, (
                f"{name} step {want['step']} {key}: {have[key]!r}, stored {want[key]!r}")
        for key in EXACT.get(name, ()):
            assert have[key] == want[key], f"{name} step {want['step']} {key}: {have[key]!r}, stored {want[key]!r}"


if __name__ == "__main__" and sys.argv[1:2] == ["--regenerate"]:
    import tempfile

    for source in sys.argv[2:] or SOURCES:  # all, or the sources named after the flag
        with tempfile.TemporaryDirectory() as tmp:
            curve = run_curve(source, Path(tmp) / source)
        (GOLDEN / f"{source}.json").write_text(json.dumps(curve, indent=1) + "\n")
        print(source, curve)

"""The `code` generator (rollout/generators/code.py), a code-execution environment in one module: each answer's
program runs in the tool sandbox under rollout.code's limits, reward.function=execution grades what it printed, and
a run trains on it. An engine stand-in writes the programs (a tiny random policy writes none)."""
import pickle
import re

import pytest
import torch

from portagrpo.rollout.engines import ROLLOUT_ENGINES, Sampled

FAST = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "data.train_size=32", "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=48",
        "trainer.plot=false", "trainer.tensorboard=false", "reward.num_workers=0", "trainer.total_steps=2",
        "data.task=calc", "rollout.generator=code", "reward.function=execution", "rollout.code.workers=1",
        "rollout.engine=fixed"]


class WritesPrograms:
    """Answers each `a <op> b` prompt with, by its sample's place in the group: a right program, a wrong one, one
    that raises, and prose without a program."""

    holds_weights = False
    needs_weights = False
    max_model_len = None
    takes_images = False

    @classmethod
    def from_run(cls, inputs):
        return cls(inputs.tokenizer, inputs.settings.n)

    def __init__(self, tokenizer, n: int) -> None:
        self.tok, self.pad_id, self.eos_ids, self.n = tokenizer, tokenizer.pad_token_id, [tokenizer.eos_token_id], n

    def answer(self, prompt: str, sample: int) -> str:
        a, word, b = re.search(r"(\d+) (plus|minus|times) (\d+)", prompt).groups()
        expression = f"{a} {dict(plus='+', minus='-', times='*')[word]} {b}"
        return ["```python\nprint(" + expression + ")\n```", "```python\nprint(" + expression + " + 1)\n```",
                "```py\nraise ValueError('no')\n```", "it is a number"][sample % 4]

    def generate(self, prompt_ids, prompt_mask, params, images=None) -> Sampled:
        rows = []
        for i, (ids, m) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
            text = self.tok.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True)
            rows.append((self.tok(self.answer(text, i % self.n), add_special_tokens=False)["input_ids"]
                         + self.eos_ids)[:params.max_tokens])
        width = params.max_tokens
        tokens = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in rows], device=prompt_ids.device)
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], device=prompt_ids.device)
        return Sampled(tokens, mask, -mask)

    def turns(self):
        import contextlib

        return contextlib.nullcontext()


def test_programs_are_found_in_the_answers():
    from portagrpo.rollout.generators.code import program_of

    assert program_of("first ```\nprint(1)\n``` then ```python\nprint(2)\n``` and ```\nprint(3)\n```") == "print(2)\n"
    assert program_of("```\nprint(3)\n```") == "print(3)\n"
    assert program_of("print(4)") is None


def test_each_answer_runs_in_the_sandbox_and_the_reward_grades_what_it_printed(tmp_path, monkeypatch):
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", WritesPrograms)
    cfg = load_config(None, FAST)
    t = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        scored = t.schedule.next(1)
        rb = scored.rollout
        runs = [info["execution"] for info in rb.extra_info]
        assert [r["error"] for r in runs[:4]] == [None, None, "exception", "no_code"]
        assert runs[0]["output"].strip() == rb.ground_truth[0]  # what the right program printed
        assert int(runs[1]["output"]) == int(rb.ground_truth[1]) + 1 and "ValueError: no" in runs[2]["output"]
        assert scored.scores.tolist() == [1.0, 0.0, 0.0, 0.0] * 2
        assert scored.correct.tolist() == [True, False, False, False] * 2
        assert scored.rollout_metrics == {"code/program_frac": 0.75, "code/exception_frac": 0.25,
                                          "code/timeout_frac": 0.0, "code/memory_frac": 0.0, "code/output_frac": 0.0,
                                          "code/crash_frac": 0.0, "code/other_frac": 0.0}
        metrics = t.step().metrics  # and a step trains on the graded batch
        assert metrics["reward_mean"] == pytest.approx(0.25) and metrics["code/program_frac"] == 0.75
    finally:
        t.close()


def test_a_program_past_its_limit_is_stopped_by_the_generators_own_setting():
    from portagrpo.config import load_config
    from portagrpo.model.loading import build_char_tokenizer
    from portagrpo.rollout.generators import GeneratorInputs, generator_spec, make_generator

    cfg = load_config(None, [*FAST, "rollout.code.timeout_s=1"])
    spec = generator_spec(cfg)
    assert pickle.loads(pickle.dumps(spec)) == spec and spec.settings.timeout_s == 1.0  # it crosses to a sampler
    rows = make_generator(spec, GeneratorInputs(build_char_tokenizer()))
    try:
        loop, ok, done, failed = rows.run(["```python\nwhile True: pass\n```", "```python\nprint(7)\n```",
                                           "```python\nimport sys\nprint(8)\nsys.exit()\n```",
                                           "```python\nimport sys\nprint(9)\nsys.exit(3)\n```"])
        assert loop["error"] == "timeout" and "1s" in loop["output"] and ok == {"output": "7\n", "error": None}
        assert done == {"output": "8\n", "error": None}  # sys.exit() with status 0: the program ended well
        assert failed["error"] == "exception"
    finally:
        rows.close()


@pytest.mark.parametrize("override,words", [
    ("reward.function=auto", "rollout.generator=code runs each answer's program, and reward.function='auto'"),
    ("rollout.code.sandbox=jail", "rollout.code.sandbox='jail' is unknown"),
    ("rollout.code.timeout_s=0", "rollout.code.timeout_s=0.0 must be positive"),
])
def test_a_config_the_generator_cannot_run_is_one_sentence(capsys, override, words):
    from portagrpo.cli import main

    code = main(["train", "--dry-run", *FAST, override])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err


def test_the_execution_reward_needs_the_code_generator(capsys):
    from portagrpo.cli import main

    code = main(["train", "--dry-run", *[o for o in FAST if o != "rollout.generator=code"], "rollout.generator=text"])
    err = capsys.readouterr().err
    assert code == 2 and "reward.function='execution' grades what each answer's program printed" in err

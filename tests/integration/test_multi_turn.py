"""Multi-turn, tool-using GRPO end to end through the CLI: the tiny policy on the hf engine with the calculator, and
a scripted engine that calls the tool every step (so tool turns are certainly in the trained batches)."""
import contextlib
import json
import math

import torch

from portagrpo.cli import main
from portagrpo.metrics import read_metrics
from portagrpo.rollout.engines import ROLLOUT_ENGINES, Sampled

FAST = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "data.train_size=32", "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=48",
        "trainer.plot=false", "trainer.tensorboard=false", "reward.num_workers=0", "trainer.total_steps=2",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_workers=1"]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def _tools(tmp_path) -> str:
    schema = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "calculator", "tool_schema": schema}]}))
    return f"rollout.multi_turn.tool_config_path={path}"


class ScriptedTools:
    """Calls the calculator in its first turn and answers after the tool's result; log-probs -1 per token."""

    holds_weights = False
    needs_weights = False
    max_model_len = None

    def turns(self):
        return contextlib.nullcontext()

    @classmethod
    def from_run(cls, inputs):
        return cls(inputs.tokenizer)

    def __init__(self, tokenizer) -> None:
        self.tok, self.pad_id, self.eos_ids = tokenizer, tokenizer.pad_token_id, [tokenizer.eos_token_id]

    def generate(self, prompt_ids, prompt_mask, params) -> Sampled:
        rows, masks = [], []
        for ids, m in zip(prompt_ids.tolist(), prompt_mask.tolist()):
            context = self.tok.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True)
            reply = "42" if "\nt:" in context else CALL
            tokens = (self.tok(reply, add_special_tokens=False)["input_ids"] + self.eos_ids)[:params.max_tokens]
            pad = params.max_tokens - len(tokens)
            rows.append(tokens + [self.pad_id] * pad)
            masks.append([1.0] * len(tokens) + [0.0] * pad)
        mask = torch.tensor(masks)
        return Sampled(torch.tensor(rows, device=prompt_ids.device), mask.to(prompt_ids.device),
                       (-mask).to(prompt_ids.device))


def test_calculator_run_on_the_hf_engine_trains(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *FAST, _tools(tmp_path)]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["grad_norm"]) for r in rows)
    assert all(r["tool/errors"] <= r["tool/calls"] and r["turns_mean"] >= 1 for r in rows)


def test_scripted_tool_calls_train_with_rollout_correction(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", ScriptedTools)  # an engine every backend runs
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *FAST, _tools(tmp_path), "rollout.engine=fixed",
                 "algorithm.rollout_correction.rollout_is=token", "actor.ppo_epochs=2",
                 "data.max_response_length=128"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["grad_norm"]) for r in rows)
    for r in rows:  # every sample called the calculator once and then answered
        assert (r["tool/calls"], r["tool/errors"], r["tool/timeouts"], r["turns_mean"]) == (4, 0, 0, 2.0)


def test_a_recorded_multi_turn_run_replays_exactly(tmp_path, monkeypatch):
    """The record keeps the model-token mask, so the replay trains the same tokens (tool tokens still untrained)."""
    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", ScriptedTools)
    run, out = tmp_path / "run", tmp_path / "replay"
    assert main(["train", "--output-dir", str(run), *FAST, _tools(tmp_path), "rollout.engine=fixed",
                 "data.max_response_length=128", "trainer.record_rollouts=true", "actor.ppo_epochs=2"]) == 0
    assert main(["replay", str(run), "--device", "cpu", "--output-dir", str(out)]) == 0
    report = json.loads((out / "replay.json").read_text())
    assert len(report["steps"]) == 2
    assert all(v["error"] < 1e-12 for v in report["verdict"].values()), report["verdict"]


def test_two_ranks_match_one(tmp_path):
    """Two local ranks gather the model-token mask and sum the tool metrics; the fixed engine's rollouts do not
    depend on the rank, so the runs agree (tools configured, the fixed engine calls none)."""
    import os
    import subprocess
    import sys

    import pytest

    from portagrpo.metrics import MEASURED_KEYS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", *FAST, _tools(tmp_path),
              "rollout.engine=fixed", "actor.micro_batch_size=2"]
    rows = []
    for nproc in (1, 2):
        run = tmp_path / f"run{nproc}"
        res = subprocess.run([*common, f"trainer.nproc_per_node={nproc}", "--output-dir", str(run)], env=env,
                             capture_output=True, text=True, timeout=600, cwd="/")
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        rows.append(read_metrics(run / "metrics.jsonl"))
    for one, two in zip(*rows):
        assert two["world_size"] == 2 and two["tool/calls"] == one["tool/calls"] and two["turns_mean"] == 1.0
        for key, value in one.items():
            if key not in MEASURED_KEYS and key != "world_size":
                assert two[key] == pytest.approx(value, rel=2e-5, abs=1e-7), key


def test_resume_continues_exactly(tmp_path):
    """A multi-turn run keeps nothing in flight: its sampling stream is the step's, so a resumed run repeats it."""
    import pytest

    from portagrpo.metrics import MEASURED_KEYS

    full, part = tmp_path / "full", tmp_path / "part"
    steps = [a for a in FAST if not a.startswith("trainer.total_steps")]
    common = [*steps, _tools(tmp_path), "trainer.save_freq=2"]
    assert main(["train", "--output-dir", str(full), *common, "trainer.total_steps=4"]) == 0
    assert main(["train", "--output-dir", str(part), *common, "trainer.total_steps=2"]) == 0
    assert main(["train", "--output-dir", str(part), *common, "trainer.total_steps=4", "--resume", str(part)]) == 0
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a[2:], b[2:]):
        for key in ra:
            if key not in MEASURED_KEYS:
                assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), key


def _children(pid: int) -> list[int]:
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_kill_9_leaves_no_tool_worker_and_resumes_exactly(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import pytest

    from portagrpo.metrics import MEASURED_KEYS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    steps = [a for a in FAST if not a.startswith("trainer.total_steps")]
    common = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", *steps, _tools(tmp_path),
              "trainer.save_freq=2", "trainer.total_steps=4"]
    full, part = tmp_path / "full", tmp_path / "part"
    res = subprocess.run([*common, "--output-dir", str(full)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    proc = subprocess.Popen([*common, "--output-dir", str(part), "trainer.total_steps=400"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (part / "checkpoints" / "step_00000002" / "manifest.json").is_file():
            assert proc.poll() is None, "the run ended before its checkpoint"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert workers  # the sandbox's workers (and any other child of the trainer)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for _ in range(100):  # the workers follow their parent (parent-death signal)
        alive = [p for p in workers if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, alive
    res = subprocess.run([*common, "--output-dir", str(part), "--resume", str(part / "checkpoints" / "step_00000002")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b][-2:] == [3, 4]
    for ra, rb in zip(a[2:4], [r for r in b if r["step"] in (3, 4)]):
        for key in ra:
            if key not in MEASURED_KEYS:
                assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-6), key


class EveryTurnCallsATool:
    """A toolbox stand-in: every finished model turn gets a tool result, so conversations go on for turns."""

    specs = {}

    def answer(self, turns, counts=None):
        from portagrpo.agent.sandbox import ToolResult

        return [[ToolResult("7")] for _ in turns]


def test_sampler_logprobs_of_model_tokens_equal_the_trainers_over_the_conversation(tmp_path):
    """The model's tokens are kept as sampled and the tool turns are the same ids in the trainer's context: the hf
    engine's log-probs turn by turn equal the trainer's scoring of the whole conversation, on model tokens."""
    from portagrpo.agent.hermes import ToolTurns
    from portagrpo.config import load_config
    from portagrpo.data.records import PromptRecord
    from portagrpo.rollout.generators.conversation import Conversations
    from portagrpo.tolerances import assert_close
    from portagrpo.train import Trainer

    cfg = load_config(None, [*FAST, _tools(tmp_path), "rollout.temperature=1.5", "data.max_response_length=160"])
    t = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        s = t.pipeline
        loop, engine = Conversations(s.tokenizer, EveryTurnCallsATool(), ToolTurns(s.tokenizer, 8), 4), s.engine
        records = [PromptRecord(i, f"{i}+{i}=", str(2 * i), "x") for i in range(4)]
        s.runtime.backend.seed(11)
        rb = loop.rollout(engine, records, 2, s.settings.sampling, s.runtime.device).rollout
        turns = rb.model_mask.diff(dim=1, prepend=torch.zeros_like(rb.model_mask[:, :1])).clamp(min=0).sum(1)
        assert turns.max() >= 2  # conversations of several turns were sampled
        scored, _ = s.logprobs.logprobs(t.models.scorer, rb, entropy=False)
        own = rb.model_mask.bool()
        assert_close(rb.rollout_logp[own], scored[own].float(), torch.float32, "logprob", "sampler vs trainer")
        assert torch.all(rb.rollout_logp[~own] == 0)
    finally:
        t.close()


def test_validation_samples_conversations_too(tmp_path, monkeypatch):
    """Held-out validation of a multi-turn run uses the tools: the reward sees the calculator's result."""
    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", ScriptedTools)
    reward = tmp_path / "saw_tool.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if 't:42' in solution_str else 0.0\n")
    run = tmp_path / "run"
    steps = [a for a in FAST if not a.startswith("trainer.test_freq")]
    assert main(["train", "--output-dir", str(run), *steps, _tools(tmp_path), "rollout.engine=fixed",
                 "data.max_response_length=128", "trainer.test_freq=1", "data.val_size=4",
                 f"reward.function={reward}:score"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert all(r["reward_mean"] == 1.0 for r in rows)
    assert [r["val/reward_mean"] for r in rows if "val/reward_mean" in r] == [1.0, 1.0]

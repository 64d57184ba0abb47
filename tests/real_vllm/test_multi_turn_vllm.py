"""Multi-turn, tool-using rollouts on a real vLLM (the CPU build): conversations sampled turn by turn keep the
model's token ids, so vLLM's log-probs of the model's tokens equal the trainer's scoring of the whole conversation
(tool turns in the context), and `portagrpo train` with `rollout.multi_turn.enable=true` completes on one rank and
on two ranks holding one tensor-parallel engine (every rank in every turn's generate)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real_vllm
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8",
         "data.train_size=32", "data.val_size=8", "data.max_response_length=48", "trainer.test_freq=0",
         "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_workers=1", "trainer.save_freq=0"]


def _tools(folder: Path) -> str:
    schema = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    path = folder / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "calculator", "tool_schema": schema}]}))
    return f"rollout.multi_turn.tool_config_path={path}"


class EveryTurnCallsATool:
    specs = {}

    def answer(self, turns, counts=None):
        from portagrpo.agent.sandbox import ToolResult

        return [[ToolResult("7")] for _ in turns]


def test_vllm_logprobs_of_model_tokens_equal_the_trainers_over_the_conversation(tmp_path, qwen2_dir):
    from portagrpo.agent.hermes import ToolTurns
    from portagrpo.config import load_config
    from portagrpo.data.records import PromptRecord
    from portagrpo.rollout.generators.conversation import Conversations
    from portagrpo.tolerances import assert_close
    from portagrpo.train import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", f"model.path={qwen2_dir}", "rollout.temperature=1.5",
                             *SMALL, "data.max_response_length=160", _tools(tmp_path)])
    t = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        s = t.pipeline
        loop, engine = Conversations(s.tokenizer, EveryTurnCallsATool(), ToolTurns(s.tokenizer, 8), 4), s.engine
        records = [PromptRecord(i, f"{i}+{i}=", str(2 * i), "x") for i in range(4)]
        s.runtime.backend.seed(11)
        rb = loop.rollout(engine, records, 2, s.settings.sampling, s.runtime.device).rollout
        turns = rb.model_mask.diff(dim=1, prepend=torch.zeros_like(rb.model_mask[:, :1])).clamp(min=0).sum(1)
        assert turns.max() >= 2, turns
        scored, _ = s.logprobs.logprobs(t.models.scorer, rb, entropy=False)
        own = rb.model_mask.bool()
        assert_close(rb.rollout_logp[own], scored[own].float(), torch.float32, "logprob", "vLLM vs trainer")
        assert torch.all(rb.rollout_logp[~own] == 0)
    finally:
        t.close()


def test_a_steps_turns_share_its_one_push_on_real_vllm(tmp_path, qwen2_dir):
    """Issue 45: the turns of a step sample with the step's one push. vLLM's CPU build never sleeps, so its engine kept
    its weights between turns before too; this measures it on the real engine: pushes (the engine's update_weights)
    and prefix-cache resets while a rollout of several turns runs, after the step's push."""
    from portagrpo.agent.hermes import ToolTurns
    from portagrpo.config import load_config
    from portagrpo.data.records import PromptRecord
    from portagrpo.rollout.generators.conversation import Conversations
    from portagrpo.train import Trainer
    from portagrpo.train.build import push_weights

    cfg = load_config(None, ["rollout.engine=vllm", f"model.path={qwen2_dir}", "rollout.temperature=1.5", *SMALL,
                             "data.max_response_length=160", _tools(tmp_path)])
    t = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        s, engine = t.pipeline, t.pipeline.engine
        calls = {"push": 0, "generate": 0, "reset_prefix_cache": 0}
        for name, owner in (("push", engine), ("generate", engine.llm), ("reset_prefix_cache", engine.llm)):
            method = getattr(owner, "update_weights" if name == "push" else name)

            def counted(*args, _method=method, _name=name, **kwargs):
                calls[_name] += 1
                return _method(*args, **kwargs)

            setattr(owner, "update_weights" if name == "push" else name, counted)
        push_weights(engine, t.models)  # the step's push
        loop, engine = Conversations(s.tokenizer, EveryTurnCallsATool(), ToolTurns(s.tokenizer, 4), 4), engine
        records = [PromptRecord(i, f"{i}+{i}=", str(2 * i), "x") for i in range(4)]
        s.runtime.backend.seed(11)
        loop.rollout(engine, records, 2, s.settings.sampling, s.runtime.device)
        print(f"real vLLM (CPU build), {calls['generate']} turns: pushes in the step {calls['push']}, prefix-cache "
              f"resets {calls['reset_prefix_cache']}")
        assert calls["generate"] >= 2 and calls["push"] == 1 and calls["reset_prefix_cache"] == 1
    finally:
        t.close()


def _train(run_dir: Path, *overrides: str) -> list[dict]:
    from portagrpo.metrics import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir",
                          str(run_dir), "trainer.progress_bar=false", "rollout.engine=vllm", *SMALL, *overrides],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("ranks", [1, 2])
def test_multi_turn_train_with_vllm_completes(tmp_path, qwen2_dir, ranks):
    extra = ["trainer.nproc_per_node=2", "rollout.tensor_model_parallel_size=2"] if ranks == 2 else []
    rows = _train(tmp_path / "run", f"model.path={qwen2_dir}", "trainer.total_steps=2", _tools(tmp_path), *extra)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["turns_mean"] >= 1 and row["tool/calls"] >= 0
        assert row["rollout_corr/abs_logp_diff_max"] <= 1e-4, row  # the sampler's model tokens match the trainer

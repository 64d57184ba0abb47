"""DAPO's dynamic sampling with multi-turn, tool-using rollouts: every round is sampled as conversations, groups
without a reward spread are dropped, and the rounds' batches (prompts of different widths, a model-token mask) are
concatenated into the step's batch, whose loss still counts the model's own tokens only."""
import contextlib
import json
import math
import zlib

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.cli import main
from portagrpo.metrics import read_metrics
from portagrpo.rollout.engines import ROLLOUT_ENGINES, Sampled
from portagrpo.train.record import StepRecord

FAST = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "data.train_size=64", "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=128",
        "trainer.plot=false", "trainer.tensorboard=false", "reward.num_workers=0", "trainer.total_steps=2",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_workers=1", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=50"]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def _tools(tmp_path) -> str:
    schema = {"type": "function", "function": {"name": "calculator", "description": "arithmetic", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [{"class_name": "calculator", "tool_schema": schema}]}))
    return f"rollout.multi_turn.tool_config_path={path}"


def _reward(tmp_path) -> str:
    """Prompts whose answer's characters sum to an even number score a constant (a tied group, dropped); the
    others score whether the final answer was 'yes'."""
    f = tmp_path / "yes.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    if sum(map(ord, str(ground_truth))) % 2 == 0:\n        return 0.5\n"
                 "    return 1.0 if 'yes' in solution_str else 0.0\n")
    return f"reward.function={f}:score"


class CallsThenGuesses:
    """Calls the calculator in its first turn; after the tool's result answers ' yes' or ' no', drawn from the
    context and the sample's index in its group only (never the rank), so groups differ and one rank and two ranks
    sample the same conversations. Log-probs -1 per token."""

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
        if "\nt:" not in self.tok.decode(context, skip_special_tokens=True):
            return self.tok(CALL, add_special_tokens=False)["input_ids"] + self.eos_ids
        g = torch.Generator().manual_seed(zlib.crc32(bytes(str(context), "utf8")) * 31 + sample)
        answer = " yes" if int(torch.randint(2, (1,), generator=g)) else " no"
        return self.tok(answer, add_special_tokens=False)["input_ids"] + self.eos_ids

    def generate(self, prompt_ids, prompt_mask, params) -> Sampled:
        rows, masks = [], []
        for i, (ids, m) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
            # every sample calls the tool once, so each turn's rows are whole groups in order: i % n is the sample
            tokens = self.reply([t for t, k in zip(ids, m) if k], i % self.n)[:params.max_tokens]
            pad = params.max_tokens - len(tokens)
            rows.append(tokens + [self.pad_id] * pad)
            masks.append([1.0] * len(tokens) + [0.0] * pad)
        mask = torch.tensor(masks)
        return Sampled(torch.tensor(rows, device=prompt_ids.device), mask.to(prompt_ids.device),
                       (-mask).to(prompt_ids.device))


def _batch(prompts: list[list[int]], responses: list[list[int]], own: list[list[float]] | None) -> RolloutBatch:
    """A gathered batch (token tensors and lengths), prompts left-padded to their widest, responses 4 wide."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[9] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    resp = torch.tensor([r + [9] * (4 - len(r)) for r in responses])
    rmask = torch.tensor([[1.0] * len(r) + [0.0] * (4 - len(r)) for r in responses])
    rows = len(prompts)
    return RolloutBatch(ids, mask, resp, rmask, torch.arange(rows), torch.arange(rows), [], [], [], [],
                        lengths=[(len(p), len(r)) for p, r in zip(prompts, responses)], rollout_logp=-rmask,
                        model_mask=None if own is None else torch.tensor(own))


def test_rollout_batch_cat_left_pads_prompts_and_keeps_the_model_mask():
    """Rounds whose prompts have different widths are left-padded to the widest (pad id, mask 0); the model-token
    mask goes along (a part without one trains its whole response), and selecting rows keeps it."""
    first = _batch([[1, 2], [3]], [[5, 6, 7], [5]], [[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    second = _batch([[1, 2, 3, 4]], [[8, 8]], None)
    both = RolloutBatch.cat([first, second], pad_id=0)
    assert both.prompt_ids.tolist() == [[0, 0, 1, 2], [0, 0, 9, 3], [1, 2, 3, 4]]
    assert both.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert both.model_mask.tolist() == [[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert both.trained_mask.tolist() == both.model_mask.tolist()
    assert both.host_lengths() == [(2, 3), (1, 1), (4, 2)]
    assert both.rollout_logp.tolist() == (-both.response_mask).tolist()
    picked = both.select([2, 0])
    assert picked.model_mask.tolist() == [[1, 1, 0, 0], [1, 0, 1, 0]]
    assert picked.input_ids[1].tolist() == [0, 0, 1, 2, 5, 6, 7, 9]
    assert RolloutBatch.cat([second, second], pad_id=0).model_mask is None  # single-turn rounds: none


def _expected_rows(tok, tool_ids: list[int]) -> dict[str, tuple[list[int], list[float]]]:
    """Each answer's response tokens and model mask: the call, the tool's turn (not the model's), the answer."""
    out = {}
    for answer in (" yes", " no"):
        call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        said = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out[answer] = (call + tool_ids + said, [1.0] * len(call) + [0.0] * len(tool_ids) + [1.0] * len(said))
    return out


def test_the_steps_batch_keeps_groups_with_spread_and_trains_model_tokens_only(tmp_path, monkeypatch):
    """After several rounds, the trained batch holds only groups whose rewards differ, its loss mask is exactly the
    model's tokens (the tool's turn 0), and the tool metrics count the conversations of every round."""
    from portagrpo.agent.hermes import ToolTurns
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", CallsThenGuesses)
    cfg = load_config(None, [*FAST, _tools(tmp_path), _reward(tmp_path), "rollout.engine=fixed"])
    t = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        tok = t.pipeline.tokenizer
        expected = _expected_rows(tok, ToolTurns(tok, cfg.rollout.multi_turn.max_tool_response_length).ids(["42"]))
        scored = t.schedule.next(1)
        assert scored.gen_rounds > 1  # groups were dropped and the rounds' batches concatenated
        rb = scored.rollout
        assert rb.size == 8
        for group in rb.uid.unique():
            assert scored.scores[rb.uid == group].unique().numel() > 1
        batch = t.experience.prepare(scored).batch
        for i in range(rb.size):
            tokens, own = expected[" yes" if scored.scores[i] == 1.0 else " no"]
            assert rb.responses[i, :len(tokens)].tolist() == tokens
            assert batch.mask[i].tolist() == own + [0.0] * (rb.responses.shape[1] - len(own))
        assert batch.select([3, 1]).mask.tolist() == batch.mask[[3, 1]].tolist()
        calls = 8 * scored.gen_rounds  # 2 prompts x 4 samples a round, each calls the calculator once
        assert scored.rollout_metrics == {"tool/calls": calls, "tool/errors": 0, "tool/timeouts": 0,
                                          "turns_mean": 2.0}
    finally:
        t.close()


def test_a_multi_turn_dapo_run_trains_and_its_record_replays(tmp_path, monkeypatch):
    """The CLI run logs the tool metrics of every round; its records keep the model-token mask (the tool's turn 0),
    so a replay trains the same tokens."""
    monkeypatch.setitem(ROLLOUT_ENGINES.mapping, "fixed", CallsThenGuesses)
    run, out = tmp_path / "run", tmp_path / "replay"
    assert main(["train", "--output-dir", str(run), *FAST, _tools(tmp_path), _reward(tmp_path),
                 "rollout.engine=fixed", "trainer.record_rollouts=true", "actor.ppo_epochs=2"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["grad_norm"]) for r in rows)
    assert any(r["gen_rounds"] > 1 for r in rows)
    for r in rows:
        assert r["zero_std_group_frac"] == 0.0
        assert (r["tool/calls"], r["tool/errors"], r["turns_mean"]) == (8 * r["gen_rounds"], 0, 2.0)
    record = StepRecord.load(run / "rollouts" / "step_00000001.pt")
    own, context = record.rollout["model_mask"], record.rollout["response_mask"]
    assert bool((own <= context).all()) and bool(((context - own).sum(1) > 0).all())  # tool tokens in every row
    assert main(["replay", str(run), "--device", "cpu", "--output-dir", str(out)]) == 0
    report = json.loads((out / "replay.json").read_text())
    assert all(v["error"] < 1e-12 for v in report["verdict"].values()), report["verdict"]


def test_two_ranks_match_one(tmp_path):
    """Two local ranks sample their shares of every round and gather them (the model-token mask too), keep the same
    groups and sum the tool metrics of every round: the same trained batch and metrics as one rank."""
    import os
    import subprocess
    import sys

    import pytest

    from portagrpo.metrics import MEASURED_KEYS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results = []
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        out.mkdir()
        script = [__file__, str(out), _tools(tmp_path), _reward(tmp_path)]
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2"]
        res = subprocess.run([*launch, *script], env=env, capture_output=True, text=True, timeout=600, cwd="/")
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        results.append(torch.load(out / "result.pt", weights_only=False))
    one, two = results
    assert (one["world"], two["world"]) == (1, 2) and any(m["gen_rounds"] > 1 for m in one["metrics"])
    for a, b in zip(one["batches"], two["batches"]):
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
        assert bool((a["mask"] < a["response_mask"]).any())  # tool tokens, untrained
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        assert m2["tool/calls"] == m1["tool/calls"] == 8 * m1["gen_rounds"]
        for key, value in m1.items():
            if key not in MEASURED_KEYS and key != "world_size":
                assert m2[key] == pytest.approx(value, rel=2e-5, abs=1e-7), key


def _rank_trains(out: str, tools: str, reward: str) -> None:
    """One rank of `test_two_ranks_match_one` (this file run as a script, alone or under portagrpo.launcher): two
    steps; rank 0 keeps the metrics and each trained batch's tokens and masks."""
    from pathlib import Path

    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    ROLLOUT_ENGINES.set("fixed", CallsThenGuesses)
    cfg = load_config(None, [*FAST, tools, reward, "rollout.engine=fixed", "actor.micro_batch_size=2"])
    trainer = Trainer(cfg, run_dir=Path(out) / "run", log=lambda m: None).setup()
    try:
        metrics, batches = [], []
        for _ in range(2):
            step = trainer.step()
            b = step.experience.batch
            metrics.append(step.metrics)
            batches.append({"uid": b.rollout.uid, "prompt_ids": b.rollout.prompt_ids, "responses": b.rollout.responses,
                            "response_mask": b.rollout.response_mask, "mask": b.mask})
        if trainer.runtime.comm.is_main:
            torch.save({"metrics": metrics, "batches": batches, "world": trainer.runtime.comm.world_size},
                       Path(out) / "result.pt")
    finally:
        trainer.close()


if __name__ == "__main__":
    import sys

    _rank_trains(*sys.argv[1:4])

"""Rollouts that compose (issue 42): every generator (text, vision, conversation) with every group filter (all, and
DAPO's acc and score) under every schedule (sync, one_step_off), on the hf engine and on vLLM (the stand-in of
tests/standins/fake_vllm.py; real vLLM in tests/real_vllm), trains two steps. One rank runs every cell; two ranks run a
subset (each rank samples its own share with its own stream, so their batches are not one rank's: they train, and
the gathered batch holds every rank's groups). docs/config.md "What runs with what" lists the cells."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "tests" / "standins"
sys.path.insert(0, str(STANDINS))
from fake_vllm import FakeLLM  # noqa: E402
from fake_vllm import modules as fake_vllm_modules  # noqa: E402

BASE = ["trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.plot=false",
        "trainer.tensorboard=false", "trainer.total_steps=2", "data.train_batch_size=2", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "data.train_size=16", "data.val_size=2",
        "reward.num_workers=0", "trainer.num_threads=1", "algorithm.filter_groups.max_num_gen_batches=20",
        "rollout.vllm_weight_bucket_mb=0"]
GENERATORS = {
    "text": ["data.max_response_length=8"],
    "vision": ["model.tiny.vision=true", "data.task=colours", "data.max_response_length=6"],
    "conversation": ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_workers=1",
                     f"rollout.multi_turn.tool_config_path={ROOT / 'configs' / 'tools' / 'calculator.yaml'}",
                     "data.max_response_length=16"],
}
FILTERS = {"all": [], "acc": ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
           "score": ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"]}
SCHEDULES = {"sync": [], "one_step_off": ["rollout.mode=one_step_off"]}
CELLS = [(g, f, s, e) for g in GENERATORS for f in FILTERS for s in SCHEDULES for e in ("hf", "vllm")]
TWO_RANKS = [("conversation", "score", "sync", "hf"), ("vision", "acc", "sync", "vllm"),
             ("text", "acc", "one_step_off", "vllm")]


def _reward(tmp_path: Path) -> str:
    """A reward with a spread for a tiny random policy: correct when the response has an even length."""
    f = tmp_path / "even.py"
    f.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    ok = len(solution_str) % 2 == 0\n"
                 "    return {'score': float(ok) + 0.01 * len(solution_str), 'correct': ok}\n")
    return f"reward.function={f}:score"


def overrides(cell, tmp_path: Path) -> list[str]:
    generator, group_filter, schedule, engine = cell
    return [*BASE, *GENERATORS[generator], *FILTERS[group_filter], *SCHEDULES[schedule], f"rollout.engine={engine}",
            _reward(tmp_path)]


@pytest.fixture()
def standin_vllm(monkeypatch):
    """The stand-in as vLLM's CPU build, here and (through tests/standins/vllm_shim on sys.path, which a spawned
    sampler process inherits) in a sampler process."""
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances.clear()
    monkeypatch.setattr(FakeLLM, "ascend", None)
    monkeypatch.setattr(FakeLLM, "platform", "cpu")
    monkeypatch.syspath_prepend(str(STANDINS / "vllm_shim"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def train(cfg_overrides: list[str], run_dir: Path) -> list[dict]:
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    trainer = Trainer(load_config(None, cfg_overrides), run_dir=run_dir, log=lambda m: None).setup()
    try:
        return [trainer.step().metrics.row() for _ in range(2)]
    finally:
        trainer.close()


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_cell_trains_two_steps_on_one_rank(cell, tmp_path, request):
    generator, group_filter, schedule, engine = cell
    if engine == "vllm":
        request.getfixturevalue("standin_vllm")
    rows = train(overrides(cell, tmp_path), tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss_policy"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["gen_rounds"] >= 1 and (group_filter != "all" or r["gen_rounds"] == 1)
        if group_filter != "all":
            assert r["zero_std_group_frac"] == 0.0  # only groups with a spread were kept
        if generator == "conversation":
            assert r["turns_mean"] >= 1 and "tool/calls" in r
    assert [r.get("rollout_staleness") for r in rows] == ([0, 1] if schedule == "one_step_off" else [None, None])


@pytest.mark.parametrize("cell", TWO_RANKS, ids=["-".join(c) for c in TWO_RANKS])
def test_a_subset_trains_on_two_ranks(cell, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(STANDINS / "vllm_shim"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out.pt"
    launch = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", __file__, str(out),
              *overrides(cell, tmp_path)]
    res = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = torch.load(out, weights_only=False)
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert all(math.isfinite(r["loss_policy"]) and math.isfinite(r["grad_norm"]) for r in rows)
    if cell[1] != "all":
        assert all(r["zero_std_group_frac"] == 0.0 for r in rows)


if __name__ == "__main__":  # one rank of test_a_subset_trains_on_two_ranks, under portagrpo.launcher
    import vllm  # noqa: F401 - the stand-in (tests/standins/vllm_shim on PYTHONPATH)

    rows = train(sys.argv[2:], Path(sys.argv[1]).parent / "run")
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(rows, sys.argv[1])


def test_two_ranks_agree_with_one_where_the_samples_do_not_depend_on_the_rank(tmp_path):
    """With an engine whose samples depend only on the prompt and the sample's index (`fixed`), two ranks keep the same
    groups over DAPO's rounds and train as one rank does: the design's agreement, through the same pipeline."""
    from portagrpo.metrics import MEASURED_KEYS

    tied = tmp_path / "tied.py"  # prompts asking for an even digit score 0.5 whatever the response: dropped
    tied.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if int(ground_truth) % 2 == 0:\n        return 0.5\n"
                    "    return float(len(solution_str) % 2 == 0)\n")
    cfg = [*overrides(("text", "score", "sync", "fixed"), tmp_path), "actor.micro_batch_size=2",
           f"reward.function={tied}:score"]
    one = train(cfg, tmp_path / "one")
    out = tmp_path / "two.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(STANDINS / "vllm_shim"), str(ROOT)])}
    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", __file__, str(out), *cfg],
                         env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = torch.load(out, weights_only=False)
    assert any(r["gen_rounds"] > 1 for r in one)  # groups were dropped and more rounds sampled
    for a, b in zip(one, two):
        for key, value in a.items():
            if key not in MEASURED_KEYS and key != "world_size" and not key.startswith(("mem/", "time_")):
                assert b[key] == pytest.approx(value, rel=2e-5, abs=1e-7), key


def test_the_example_generator_of_docs_design_trains_through_every_stage(tmp_path):
    """rollout.generator=echo (rollout/generators/echo.py, docs/design.md "Adding a generator"): one module and its
    registration; the pipeline shares, scores and gathers its rows, and its counts come back as metrics (a group of
    echoes never differs, so DAPO's filters would keep none of them)."""
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = load_config(None, [*BASE, "rollout.generator=echo", "data.max_response_length=4", _reward(tmp_path)])
    trainer = Trainer(cfg, run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        out = trainer.step()
    finally:
        trainer.close()
    rb, row = out.experience.batch.rollout, out.metrics.row()
    tails = [p[m.bool()][-4:].tolist() for p, m in zip(rb.prompt_ids, rb.prompt_mask)]
    assert [r[m.bool()].tolist() for r, m in zip(rb.responses, rb.response_mask)] == tails  # each its prompt's tail
    assert rb.rollout_logp is None and row["echo/tokens_mean"] == 4.0 and math.isfinite(row["loss_policy"])


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_vision_language_policy_in_a_tool_conversation_trains(engine, tmp_path, request):
    """Images x multi-turn: the conversation generator on the tiny VL policy, each prompt's image carried through the
    turns, with the calculator's tools; on the hf engine and vLLM (the stand-in)."""
    if engine == "vllm":
        request.getfixturevalue("standin_vllm")
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = [*BASE, *GENERATORS["conversation"], "model.tiny.vision=true", "data.task=colours",
           f"rollout.engine={engine}", _reward(tmp_path)]
    trainer = Trainer(load_config(None, cfg), run_dir=tmp_path / "run", log=lambda m: None).setup()
    try:
        outs = [trainer.step() for _ in range(2)]
    finally:
        trainer.close()
    for out in outs:
        assert math.isfinite(out.metrics.row()["loss_policy"]) and "turns_mean" in out.metrics.row()
        assert out.experience.batch.rollout.images is not None  # the conversations' rows kept their images

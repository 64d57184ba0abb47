"""`rollout.engine=vllm` against a real vLLM (the CPU build): the engine builds, samples distinct
completions in every group, reports the log-probs it drew with, receives every weight push, and a
`portagrpo train` run with it completes, on one rank and on two ranks holding one engine between them
(tensor parallel under vLLM's external launcher); a model whose head size vLLM's CPU attention lacks is
refused in one sentence.

The sampler's log-probs are checked against the trainer's own in fp32, in both directions: equal (within
portagrpo/tolerances.py) just after a push, and different after an update that was not pushed, so that a
push that silently leaves the engine's weights (or part of them) as they were fails here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.tolerances import assert_close, relative_error, tolerance

pytestmark = pytest.mark.real_vllm
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8",
         "data.train_size=32", "data.val_size=8", "data.max_response_length=8", "trainer.test_freq=0"]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, qwen2_dir):
    """One trainer (and so one vLLM engine) for the module's in-process tests."""
    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    cfg = load_config(None, ["rollout.engine=vllm", f"model.path={qwen2_dir}", f"rollout.temperature={TEMPERATURE}",
                             "actor.lr=1e-3", *SMALL, "data.max_prompt_length=160"])  # room for a full KV block
    t = Trainer(cfg, run_dir=tmp_path_factory.mktemp("run"), log=lambda m: None).setup()
    yield t
    t.close()


def _groups_distinct(rb, n: int) -> list[int]:
    """Distinct completions per group (rows come n per prompt)."""
    rows = [tuple(r[m.bool()].tolist()) for r, m in zip(rb.responses, rb.response_mask)]
    return [len(set(rows[i:i + n])) for i in range(0, len(rows), n)]


def test_the_engine_is_vllm_and_samples_distinct_completions_in_each_group(trainer):
    engine = trainer.parts.engine
    assert type(engine.llm).__module__.startswith("vllm."), type(engine.llm)
    records = trainer.parts.data.loader.next_batch()
    rb = trainer.pipeline.rollout(records, 4, SamplingParams(8, 0.8, top_k=20), uid_base=0)
    assert rb.responses.shape == (16, 8)
    assert all(k > 1 for k in _groups_distinct(rb, 4)), _groups_distinct(rb, 4)
    mask = rb.response_mask.bool()
    assert mask.any(dim=1).all()  # every completion has at least one token
    logp = rb.rollout_logp
    assert logp is not None and torch.isfinite(logp).all()
    assert (logp[mask] <= 0).all() and (logp[mask] < 0).any() and (logp[~mask] == 0).all()


def _trainer_logp(policy, rb, params: SamplingParams) -> torch.Tensor:
    """[B, T] the trainer's fp32 log-probs of the sampled tokens under the distribution the sampler draws
    from: the policy's logits with temperature, top-k and top-p applied (transformers' warpers, in the
    order the hf engine applies them), renormalised over the kept tokens."""
    from portagrpo.model.loading import position_ids_from_mask
    from portagrpo.rollout.engines import SampledLogprobs

    prompt_len, width = rb.prompt_len, rb.responses.shape[1]
    attention = torch.cat([rb.prompt_mask, torch.ones_like(rb.responses)], dim=1)  # right padding: causal, unseen
    with torch.no_grad():
        logits = policy(input_ids=rb.input_ids, attention_mask=attention,
                        position_ids=position_ids_from_mask(attention)).logits.float()
    scores = logits[:, prompt_len - 1:prompt_len - 1 + width].reshape(-1, logits.shape[-1])
    dummy = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    for warp in SampledLogprobs(params).warpers:
        scores = warp(dummy, scores)
    logp = torch.log_softmax(scores, dim=-1).gather(1, rb.responses.reshape(-1, 1)).reshape(rb.responses.shape)
    return logp * rb.response_mask


def _gaps(t, records, truncated: SamplingParams) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(sampler, trainer) log-probs of the tokens of two fresh rollouts, on response tokens: one at the run's
    temperature against the trainer's own scoring (what `rollout_corr/*` compares), one with top-k and top-p
    against the trainer's logits truncated the same way."""
    plain = t.pipeline.rollout(records, 4, SamplingParams(8, TEMPERATURE), uid_base=0)
    scored, _ = t.pipeline.logprobs.logprobs(t.models.scorer, plain, entropy=False)
    cut = t.pipeline.rollout(records, 4, truncated, uid_base=0)
    out = {}
    for name, rb, ref in (("temperature", plain, scored), ("top-k/top-p", cut, _trainer_logp(t.models.policy, cut,
                                                                                               truncated))):
        mask = rb.response_mask.bool()
        out[name] = (rb.rollout_logp[mask], ref[mask].float())
    return out


def test_sampler_logprobs_equal_the_trainers_after_a_push_and_differ_after_an_unpushed_update(trainer):
    """After a step (update, then the trainer's push) the engine samples from the trainer's weights: its
    processed log-probs equal the trainer's in fp32. An update that is not pushed must show (else a push
    that does nothing would pass), and pushing it closes the gap again."""
    from portagrpo.train.build import push_weights

    t = trainer
    t.step()
    records = t.parts.data.loader.next_batch()
    truncated = SamplingParams(8, TEMPERATURE, top_p=0.9, top_k=20)
    for name, (sampler, ours) in _gaps(t, records, truncated).items():
        print(f"GAP {name} just after a push: relative {relative_error(sampler, ours):.2e}, "
              f"max abs {(sampler - ours).abs().max():.2e} over {sampler.numel()} tokens")
        assert_close(sampler, ours, torch.float32, "logprob", f"{name}: sampler vs trainer just after a push")

    with torch.no_grad():  # an update the engine is not told about
        g = torch.Generator().manual_seed(0)
        for p in t.models.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    bound = tolerance(torch.float32, "logprob")
    for name, (sampler, ours) in _gaps(t, records, truncated).items():
        # a token the trainer's truncation drops (log-prob -inf) differs too
        gap = relative_error(sampler, ours) if torch.isfinite(ours).all() else float("inf")
        print(f"GAP {name} after an unpushed update: relative {gap:.2e}")
        assert gap > 100 * bound, f"{name}: the engine sampled from the unpushed weights (relative gap {gap:.2e})"

    push_weights(t.parts.engine, t.models)
    for name, (sampler, ours) in _gaps(t, records, truncated).items():
        print(f"GAP {name} after pushing the unpushed update: relative {relative_error(sampler, ours):.2e}, "
              f"max abs {(sampler - ours).abs().max():.2e} over {sampler.numel()} tokens")
        assert_close(sampler, ours, torch.float32, "logprob", f"{name}: sampler vs trainer after pushing it")


def test_a_push_is_not_undone_by_kv_blocks_cached_under_the_old_weights(trainer):
    """vLLM keeps the KV blocks of the prompts it has seen (prefix caching, on by default) and reuses them for a
    prompt that starts with the same full blocks (128 tokens on the CPU). Where the engine never sleeps (its CPU
    build; a level-2 sleep clears them), a push must drop them, or the next rollout of such a prompt attends over
    keys and values of the old weights: its log-probs then differ from the trainer's by up to ~0.7 here."""
    from portagrpo.train.build import push_weights

    t = trainer
    push_weights(t.parts.engine, t.models)  # whatever the tests before did to the weights, the engine has them
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 60, (2, 150), generator=g)  # one full KV block and a part of the next
    params = SamplingParams(4, 1.0)

    def gap() -> tuple[torch.Tensor, torch.Tensor]:
        sampled = t.parts.engine.generate(ids, torch.ones_like(ids), params)
        with torch.no_grad():
            logits = t.models.policy(input_ids=torch.cat([ids, sampled.responses], dim=1)).logits.float()
        ours = torch.log_softmax(logits[:, ids.shape[1] - 1:-1], dim=-1).gather(
            2, sampled.responses.unsqueeze(2)).squeeze(2)
        mask = sampled.mask.bool()
        return sampled.logp[mask], ours[mask]

    assert_close(*gap(), torch.float32, "logprob", "sampler vs trainer, first sight of the prompts")
    with torch.no_grad():
        for p in t.models.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    push_weights(t.parts.engine, t.models)
    assert_close(*gap(), torch.float32, "logprob", "sampler vs trainer, the same prompts after a push")


def _cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir",
                           str(run_dir), "trainer.progress_bar=false", "rollout.engine=vllm", *SMALL, *overrides],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _train(run_dir: Path, *overrides: str) -> list[dict]:
    from portagrpo.metrics import read_metrics

    res = _cli(run_dir, *overrides)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return read_metrics(run_dir / "metrics.jsonl")


def _sampler_matches_trainer(row: dict) -> None:
    # the sampler at the run's temperature (no truncation) against the trainer, after every push: fp32 rounding
    assert abs(row["rollout_corr/kl"]) <= tolerance(torch.float32, "kl"), row
    assert row["rollout_corr/abs_logp_diff_max"] <= 1e-4, row


def test_train_with_vllm_completes(tmp_path, qwen2_dir):
    rows = _train(tmp_path / "run", f"model.path={qwen2_dir}", "trainer.total_steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["response_len_mean"] > 0 for r in rows)
    for row in rows:
        _sampler_matches_trainer(row)


def test_train_with_tensor_parallel_vllm_over_two_ranks(tmp_path, qwen2_dir):
    """Two CPU ranks hold one engine (rollout.tensor_model_parallel_size=2, vLLM's external launcher)."""
    rows = _train(tmp_path / "run", f"model.path={qwen2_dir}", "trainer.total_steps=2", "trainer.nproc_per_node=2",
                  "rollout.tensor_model_parallel_size=2")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        _sampler_matches_trainer(row)


def test_a_head_size_that_vllms_cpu_attention_lacks_is_one_sentence(tmp_path):
    """A tiny policy with 16-wide heads (64 / 4). vLLM's CPU attention runs head sizes of 32 and up
    (vllm/v1/attention/backends/cpu_attn.py: `get_supported_head_sizes`) and otherwise fails inside its first
    forward ("RuntimeError: Unsupported CPU attention configuration: head_dim=16"): a traceback after the
    engine was built, where a sentence naming the head size belongs."""
    res = _cli(tmp_path / "run", "trainer.total_steps=1", "model.tiny.num_heads=4")
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-4000:])
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    assert any("head" in line and "16" in line for line in res.stderr.splitlines()), res.stderr[-2000:]

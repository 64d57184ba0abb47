"""Train what you sample: a saved Qwen2 whose generation_config restricts sampling (top_k, top_p, min_p,
repetition_penalty, an extra EOS) and whose attention has dropout. Nothing of that file may leak into
what portagrpo samples or scores."""
import json
import math

import pytest
import torch

from portagrpo.config import load_config
from portagrpo.rollout.engines import HFRollout
from portagrpo.rollout.settings import SamplingParams

FAST = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=4", "data.train_size=16",
        "data.val_size=4", "data.max_response_length=6", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.plot=false", "trainer.tensorboard=false", "actor.warmup_steps=0"]


def manual_greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    out = ids
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    return out[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer):
    """A random tiny Qwen2 with attention dropout, saved with a restrictive generation_config."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.5,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the random model a little so greedy paths differ between prompts
        model.lm_head.weight.mul_(4.0)
    prompt = torch.tensor([tokenizer.encode("copy 7:")])
    greedy = manual_greedy(model, prompt, 6)[0].tolist()
    extra_eos = next(t for t in greedy[1:] if t != tokenizer.eos_token_id)  # ends that response early
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=3, top_p=0.5, min_p=0.3,
                                               repetition_penalty=1.5,
                                               eos_token_id=[tokenizer.eos_token_id, extra_eos])
    path = tmp_path_factory.mktemp("qwen") / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "expect.json").write_text(json.dumps({"extra_eos": extra_eos, "greedy": greedy}))
    return path


def load(path):
    from portagrpo.model.loading import load_model

    return load_model(path, "sdpa").eval()


def test_off_means_off_sampling_follows_the_softmax(qwen_dir, tokenizer):
    model = load(qwen_dir)
    engine = HFRollout(model, tokenizer, lambda: torch.no_grad())
    prompt = torch.tensor([tokenizer.encode("copy 7:")])
    n = 600
    torch.manual_seed(0)
    responses, _, *_ = engine.generate(prompt.repeat(n, 1), torch.ones(n, prompt.shape[1], dtype=torch.long),
                                   SamplingParams(max_tokens=1, temperature=1.0))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompt).logits[0, -1].double(), -1)
    counts = torch.bincount(responses[:, 0], minlength=probs.numel()).double()
    # the model's file asks for top_k=3 / min_p=0.3 / top_p=0.5: at most 3 distinct tokens if it leaked
    assert int((counts > 0).sum()) > 3
    top = int(probs.argmax())
    p = float(probs[top])
    assert abs(float(counts[top]) / n - p) < 5 * math.sqrt(p * (1 - p) / n)  # not inflated by truncation


def test_greedy_has_no_repetition_penalty_and_stops_at_every_eos(qwen_dir, tokenizer):
    model = load(qwen_dir)
    expect = json.loads((qwen_dir / "expect.json").read_text())
    engine = HFRollout(model, tokenizer, lambda: torch.no_grad())
    assert engine.eos_ids == [tokenizer.eos_token_id, expect["extra_eos"]]  # tokenizer's, then the model's
    prompts = [tokenizer.encode(t) for t in ("copy 7:", "copy 3:", "say 55", "x")]
    width = max(map(len, prompts))
    from portagrpo.data.records import left_pad

    ids, mask = left_pad(prompts, engine.pad_id, width=width)
    responses, rmask, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=6, temperature=0.0))
    for row, prompt in enumerate(prompts):
        want = manual_greedy(model, torch.tensor([prompt]), 6)[0].tolist()
        stop = next((i + 1 for i, t in enumerate(want) if t in engine.eos_ids), len(want))
        assert responses[row, :stop].tolist() == want[:stop], row
        assert int(rmask[row].sum()) == stop
    first_stop = expect["greedy"].index(expect["extra_eos"]) + 1
    assert int(rmask[0].sum()) == first_stop < 6  # ended by the generation_config's EOS, as vLLM ends it
    # the setup can tell: transformers' own defaults (the old behaviour) do apply the file's penalty
    with torch.no_grad():
        leaked = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert leaked[:, width:].tolist() != responses.tolist()


def _trainer(tmp_path, qwen_dir, *overrides):
    from portagrpo.train import Trainer

    cfg = load_config(None, [*FAST, f"model.path={qwen_dir}", "data.max_prompt_length=16", *overrides])
    return Trainer(cfg, run_dir=tmp_path, log=lambda m: None).setup()


@pytest.mark.parametrize("lora", [False, True])
def test_scoring_runs_without_dropout(tmp_path, qwen_dir, lora):
    extra = ["model.lora.rank=4", "model.lora.dropout=0.5"] if lora else []
    t = _trainer(tmp_path, qwen_dir, "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", *extra)
    batch = t.experience.prepare(t.pipeline.sample_and_score(1, t.parts.data.loader.next_batch())).batch
    t.models.scorer.train()  # as during the update
    a, _ = t.pipeline.logprobs.logprobs(t.models.scorer, batch.rollout, entropy=False)
    b, _ = t.pipeline.logprobs.logprobs(t.models.scorer, batch.rollout, entropy=False)
    assert torch.equal(a, b) and t.models.scorer.training  # deterministic, and the mode is restored
    if t.models.ref_scorer is not None:
        r1, _ = t.pipeline.logprobs.logprobs(t.models.ref_scorer, batch.rollout, entropy=False)
        r2, _ = t.pipeline.logprobs.logprobs(t.models.ref_scorer, batch.rollout, entropy=False)
        assert torch.equal(r1, r2)


def test_on_policy_step_skips_the_old_logprob_pass(tmp_path, qwen_dir, monkeypatch):
    t = _trainer(tmp_path, qwen_dir, "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
                 "actor.use_kl_loss=false")
    assert t.experience.settings.on_policy
    calls = []
    real = t.pipeline.logprobs.passes  # every log-prob pass, the policy's and the reference's
    monkeypatch.setattr(t.pipeline.logprobs, "passes",
                        lambda scorer, *a, **k: calls.append(scorer) or real(scorer, *a, **k))
    m = t.step().metrics
    assert t.models.scorer not in calls  # no separate scoring pass of the policy
    assert m["ppo_kl"] == 0.0 and m["ratio_mean"] == 1.0 and m["clipfrac"] == 0.0
    assert math.isfinite(m["entropy"]) and m["entropy"] > 0
    off = _trainer(tmp_path / "off", qwen_dir, "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4")
    assert not off.experience.settings.on_policy


def test_logged_lr_is_the_rate_used_and_warmup_starts_at_zero(tmp_path, qwen_dir):
    t = _trainer(tmp_path, qwen_dir, "actor.warmup_steps=2", "actor.lr=1e-3", "actor.ppo_mini_batch_size=8",
                 "actor.micro_batch_size=8", "actor.use_kl_loss=false")
    before = [p.detach().clone() for p in t.parts.optim.params]
    lrs = [t.step().metrics["lr"]]
    assert all(torch.equal(a, b) for a, b in zip(before, t.parts.optim.params))  # lr 0: the first step changes nothing
    lrs += [t.step().metrics["lr"], t.step().metrics["lr"]]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3])


def test_kl_in_reward_with_a_full_kl_type_and_no_kl_loss_trains(tmp_path, qwen_dir):
    t = _trainer(tmp_path, qwen_dir, "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false",
                 "actor.kl_loss_type=full", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4")
    assert not t.experience.settings.on_policy  # the reward needs old log-probs before the update
    m = t.step().metrics
    assert math.isfinite(m["kl"]) and "loss_kl" not in m
    assert 0.0 <= m["response_clip_ratio"] <= 1.0 and m["tokens_per_s_per_device"] > m["response_tokens_per_s"] > 0


def test_verl_optimizer_keys_and_recipes_match_verl():
    from pathlib import Path

    cfg = load_config(None, ["actor_rollout_ref.actor.optim.betas=[0.9,0.999]",
                             "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
                             "actor_rollout_ref.actor.optim.warmup_style=cosine"])
    assert cfg.actor.betas == [0.9, 0.999] and cfg.actor.warmup_steps == 0 and cfg.actor.lr_schedule == "cosine"
    root = Path(__file__).resolve().parents[2]
    for recipe in sorted((root / "configs").glob("qwen2.5-*.yaml")):  # after verl's GSM8K and geo3k examples
        a = load_config(recipe, check_files=False).actor
        expected = 0.1 if "longcot" in recipe.name else 0.01  # the long-trace recipes follow DAPO's weight decay
        assert (a.betas, a.weight_decay) == ([0.9, 0.999], expected), recipe.name


def test_greedy_validation_with_several_samples_is_refused():
    from portagrpo.config import ConfigError

    with pytest.raises(ConfigError, match="pass@4 would equal accuracy"):
        load_config(None, ["rollout.val_n=4", "rollout.val_temperature=0"])
    assert load_config(None, ["rollout.val_n=4", "rollout.val_temperature=0.7"]).rollout.val_n == 4


# ---------------------------------------------------------------- the sampler's log-probs


def test_sampler_logprobs_equal_the_trainers_in_fp32(tmp_path, qwen_dir):
    """Identical fp32 weights, no truncation: the log-prob each token was drawn with is the trainer's
    old log-prob (to the fp32 tolerance), and the step reports the gap as verl names it."""
    from portagrpo.tolerances import TOLERANCES

    t = _trainer(tmp_path, qwen_dir, "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                 "rollout.temperature=0.8", "rollout.top_p=1.0", "rollout.top_k=-1")
    exp = t.experience.prepare(t.pipeline.sample_and_score(1, t.parts.data.loader.next_batch()))
    rb, mask = exp.batch.rollout, exp.batch.rollout.response_mask.bool()
    assert rb.rollout_logp is not None and exp.batch.old_logp is not None
    gap = (rb.rollout_logp - exp.batch.old_logp)[mask].abs().max()
    assert gap <= TOLERANCES[torch.float32]["logprob"], gap
    assert torch.all(rb.rollout_logp[~mask] == 0)
    metrics = t.step().metrics
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff", "rollout_corr/chi2_token",
                "rollout_corr/abs_logp_diff_mean", "rollout_corr/abs_logp_diff_max", "rollout_corr/eff_sample_size"):
        assert key in metrics, key
    assert metrics["rollout_corr/abs_logp_diff_max"] <= TOLERANCES[torch.float32]["logprob"]


@pytest.mark.parametrize("truncation", [["rollout.top_k=3"], ["rollout.top_p=0.5"], ["rollout.min_p=0.2"]])
def test_under_truncation_the_sampler_logprob_is_over_the_kept_tokens(tmp_path, qwen_dir, truncation):
    """The sampler's distribution is renormalised over the tokens top-k/top-p/min-p keep; the trainer's is the
    whole vocabulary at the temperature. Each sampled token's recorded log-prob is the former, checked here
    against transformers' own warpers applied to the model's logits; the ratio pi_train/pi_sampler <= 1 is the
    importance weight of the kept support."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    t = _trainer(tmp_path, qwen_dir, "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                 "rollout.temperature=0.7", *truncation)
    r = t.cfg.rollout
    warp = (TopKLogitsWarper(r.top_k) if r.top_k > 0 else TopPLogitsWarper(r.top_p) if r.top_p < 1
            else MinPLogitsWarper(r.min_p))
    exp = t.experience.prepare(t.pipeline.sample_and_score(1, t.parts.data.loader.next_batch()))
    rb = exp.batch.rollout
    from portagrpo.model.loading import position_ids_from_mask

    t.models.policy.eval()  # the test's own forward: no dropout, positions as generate counts them
    with torch.no_grad():
        logits = t.models.policy(input_ids=rb.input_ids, attention_mask=rb.attention_mask,
                                 position_ids=position_ids_from_mask(rb.attention_mask)).logits.float()
    width = rb.prompt_len
    for row in range(rb.size):
        for pos in range(int(rb.response_mask[row].sum())):
            scores = logits[row, width + pos - 1: width + pos] / r.temperature
            kept = torch.log_softmax(warp(rb.input_ids[row: row + 1, : width + pos], scores), dim=-1)
            token = rb.responses[row, pos]
            assert rb.rollout_logp[row, pos] == pytest.approx(float(kept[0, token]), abs=1e-4)
    mask = rb.response_mask.bool()
    assert torch.all(exp.batch.old_logp[mask] <= rb.rollout_logp[mask] + 1e-5)


def test_rollout_correction_trains_and_reweights_the_loss(tmp_path, qwen_dir):
    """With top-k truncation the sampler differs from the trainer: token IS weights (truncated at 2) and
    rejection change the loss, and the metrics report them."""
    reward = tmp_path / "by_length.py"  # varied rewards, so the advantages (and the loss) are not 0
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 10\n")
    common = ["actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "rollout.top_k=4", "trainer.seed=3",
              f"reward.function={reward}:score", "reward.num_workers=0"]
    plain = _trainer(tmp_path / "plain", qwen_dir, *common).step().metrics
    corrected = _trainer(tmp_path / "is", qwen_dir, *common, "algorithm.rollout_correction.rollout_is=token",
                         "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                         "algorithm.rollout_correction.rollout_rs_threshold=100").step().metrics
    assert corrected["reward_mean"] == plain["reward_mean"]  # the same samples
    assert corrected["rollout_corr/rollout_is_mean"] < 1.0  # pi_train < pi_sampler on the kept support
    assert corrected["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert corrected["loss_policy"] != pytest.approx(plain["loss_policy"], rel=1e-3)
    assert "rollout_corr/rollout_is_mean" not in plain and "rollout_corr/kl" in plain


def test_bypass_mode_uses_the_samplers_logprobs_as_the_old_ones(tmp_path, qwen_dir, monkeypatch):
    t = _trainer(tmp_path, qwen_dir, "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
                 "algorithm.rollout_correction.bypass_mode=true", "rollout.top_k=4")
    calls = []
    real = t.pipeline.logprobs.passes  # every log-prob pass, the policy's and the reference's
    monkeypatch.setattr(t.pipeline.logprobs, "passes",
                        lambda scorer, *a, **k: calls.append(scorer) or real(scorer, *a, **k))
    out = t.step()
    assert t.models.scorer not in calls  # no scoring pass before the update
    assert torch.equal(out.experience.batch.old_logp, out.experience.batch.rollout.rollout_logp)
    m = out.metrics
    assert m["ratio_mean"] < 1.0 and math.isfinite(m["entropy"])  # pi_train / pi_sampler with truncation
    assert m["rollout_corr/abs_logp_diff_mean"] > 0  # measured from the update's own first forward

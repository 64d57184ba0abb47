"""LoRA through peft: only adapters train, the reference is the adapter-free base, export merges."""
import pytest
import torch

pytest.importorskip("peft")

from portagrpo.cli import main  # noqa: E402
from portagrpo.config import load_config  # noqa: E402
from portagrpo.kernels import token_logprobs_reference  # noqa: E402

FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "data.train_size=64", "trainer.test_freq=0", "actor.lr=1e-2",
        "actor.warmup_steps=0", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj,lm_head]",
        "model.tiny.tie_word_embeddings=false"]


def _trainer(run_dir, *overrides):
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*FAST, *overrides]), run_dir=run_dir, log=lambda m: None).setup()


def _base_state(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "init_model" / "model.safetensors")


def test_only_adapters_train_and_no_reference_copy(tmp_path):
    t = _trainer(tmp_path)
    assert t.models.ref is None  # the reference is the same weights with adapters off
    trainable = {n for n, p in t.models.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in t.models.policy.named_parameters()}
    for _ in range(2):
        t.step()
    changed = {n for n, p in t.models.policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert any("lm_head" in n for n in changed)


def test_reference_logprobs_are_the_base_models(tmp_path):
    from transformers import AutoModelForCausalLM

    from portagrpo.model.scorer import ResponseScorer, response_stats

    t = _trainer(tmp_path)
    t.step()  # adapters are now non-zero
    batch = t.experience.prepare(t.pipeline.sample_and_score(2, t.parts.data.loader.next_batch())).batch
    ref_logp, _ = t.pipeline.logprobs.logprobs(t.models.ref_scorer, batch.rollout, entropy=False)
    pol_logp, _ = t.pipeline.logprobs.logprobs(t.models.scorer, batch.rollout, entropy=False)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "init_model", local_files_only=True)
    with torch.no_grad():
        direct = response_stats(ResponseScorer(base, token_logprobs_reference), batch.rollout, temperature=1.0,
                                compute_entropy=False).logp
    assert torch.allclose(ref_logp, direct, atol=1e-6)
    assert (pol_logp - ref_logp).abs().max() > 1e-4  # the adapted policy differs


def test_checkpoint_holds_the_adapter_and_merged_export_reproduces_logprobs(tmp_path):
    from transformers import AutoModelForCausalLM

    from portagrpo.model.scorer import ResponseScorer, response_stats

    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *FAST, "trainer.total_steps=3", "trainer.save_freq=3"]) == 0
    model_dir = run / "checkpoints" / "step_00000003" / "model"
    assert (model_dir / "adapter_model.safetensors").is_file() and not (model_dir / "model.safetensors").exists()
    assert main(["export", str(run), "--merge", "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    t = _trainer(tmp_path / "resumed", "trainer.total_steps=3")
    t.checkpoints.resume(run)
    batch = t.experience.prepare(t.pipeline.sample_and_score(4, t.parts.data.loader.next_batch())).batch
    adapted, _ = t.pipeline.logprobs.logprobs(t.models.scorer, batch.rollout, entropy=False)
    with torch.no_grad():
        exported = response_stats(ResponseScorer(merged, token_logprobs_reference), batch.rollout, temperature=1.0,
                                  compute_entropy=False).logp
    assert torch.allclose(exported, adapted, atol=1e-5)

"""rollout.precision: the sampler keeps its own copy of the policy in fp32, bf16 or int8, refreshed after
every update; the training weights are untouched, and the rollout_corr metrics show what it costs."""
import pytest
import torch

from portagrpo.config import ConfigError, load_config

FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "data.train_size=32", "trainer.test_freq=0", "trainer.save_freq=0",
        "data.max_response_length=8", "actor.warmup_steps=0", "actor.lr=1e-2", "trainer.plot=false",
        "trainer.tensorboard=false"]


def _trainer(tmp_path, *overrides):
    from portagrpo.train import Trainer

    return Trainer(load_config(None, [*FAST, *overrides]), run_dir=tmp_path, log=lambda m: None).setup()


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("int8", torch.float32)])
def test_the_samplers_copy_follows_the_policy_in_its_precision(tmp_path, precision, dtype):
    t = _trainer(tmp_path, f"rollout.precision={precision}")
    engine = t.parts.engine
    assert engine.holds_weights and engine.master is not t.models.policy
    steps = [t.step().metrics for _ in range(2)]
    policy = dict(t.models.policy.named_parameters())
    assert all(p.dtype == torch.float32 for p in policy.values())  # training weights stay fp32
    for name, p in engine.master.named_parameters():  # the copy holds the updated weights, in its precision
        assert p.dtype == dtype and torch.equal(p, policy[name].detach().to(dtype)), name
    gaps = [m["rollout_corr/abs_logp_diff_mean"] for m in steps]
    if precision == "fp32":
        assert max(gaps) <= 1e-5  # the same numbers as the trainer's
    else:
        assert min(gaps) > 1e-5  # lower precision samples from a (slightly) different policy
    if precision == "int8":
        from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

        layers = [m for m in engine.model.modules() if isinstance(m, DynamicInt8Linear)]
        assert layers and all(m.weight().dtype == torch.qint8 for m in layers)
        # refreshed in place after each push, bit for bit what quantizing a fresh copy gives
        import copy

        from torch.ao.quantization import quantize_dynamic

        fresh = dict(quantize_dynamic(copy.deepcopy(engine.master), {torch.nn.Linear}, dtype=torch.qint8)
                     .named_modules())
        for name, m in engine.model.named_modules():
            if isinstance(m, DynamicInt8Linear):
                w, f = m.weight(), fresh[name].weight()
                assert torch.equal(w.int_repr(), f.int_repr()) and w.q_scale() == f.q_scale(), name
                b, fb = m.bias(), fresh[name].bias()
                assert (b is None and fb is None) or torch.equal(b, fb), name
        for (name, p), (_, q) in zip(engine.model.named_parameters(), fresh.get("").named_parameters()):
            assert torch.equal(p, q), name
        assert not any(isinstance(m, DynamicInt8Linear) for m in t.models.policy.modules())


def test_rollout_correction_weights_an_int8_samplers_tokens(tmp_path):
    int8 = _trainer(tmp_path / "int8", "rollout.precision=int8", "algorithm.rollout_correction.rollout_is=token",
                    "actor.ppo_mini_batch_size=16")
    m = int8.step().metrics
    assert m["rollout_corr/rollout_is_mean"] != 1.0 and 0 < m["rollout_corr/rollout_is_eff_sample_size"] <= 1.0


def test_refusals_are_one_sentence():
    with pytest.raises(ConfigError, match=r"rollout.precision=fp8 is vLLM's block-FP8 rollout \(rollout.engine=vllm\); "
                                          r"with rollout.engine=hf use bf16"):
        load_config(None, ["rollout.precision=fp8"])
    with pytest.raises(ConfigError, match="built for rollout.engine=hf or vllm"):
        load_config(None, ["rollout.precision=bf16", "rollout.engine=fixed"])
    with pytest.raises(ConfigError, match="rollout.precision=int8 is PyTorch's dynamic int8 .* with "
                                          "rollout.engine=vllm use auto, fp32 or bf16"):
        load_config(None, ["rollout.precision=int8", "rollout.engine=vllm"])
    for precision in ("fp32", "bf16"):  # vLLM holds its weights and samples in that dtype
        load_config(None, [f"rollout.precision={precision}", "rollout.engine=vllm"])
    from portagrpo.errors import UserError
    from portagrpo.rollout.sampler_copy import SamplerCopy

    with pytest.raises(UserError, match="runs on the CPU only; on --device npu use rollout.precision=bf16"):
        SamplerCopy(torch.nn.Linear(2, 2), None, "int8", int8_ok=False, device="npu")
    from portagrpo.backends import get_backend

    assert get_backend("cpu").supports_dynamic_quantization()

"""The weight push into real vLLM's CPU build (rollout/vllm_cpu_push.py: CpuGemmWeights), on an engine whose small
layers compute with F.linear on their own weights and whose larger ones keep vLLM's prepared oneDNN GEMMs (the size
limit set between the tiny Qwen2's layer sizes, so that both kinds are in one engine):
- the first push records where vLLM's loader copies each tensor, and later pushes copy straight there;
- in fp32 the sampler's log-probs equal the trainer's just after a push, differ after an update that was not pushed,
  and equal them again after it is pushed;
- writing the weights without preparing the GEMMs again leaves the prepared layers computing with the old ones,
  so the prepared GEMMs are the ones vLLM computes with, and the push must (and does) prepare them again.
"""
from __future__ import annotations

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.tolerances import assert_close, relative_error, tolerance

pytestmark = pytest.mark.real_vllm
# between the tiny Qwen2's layer sizes (fp32): q/k/v 32 KiB, o 16 KiB, gate/up 64 KiB, down 32 KiB
MIXED_LIMIT = 40 * 1024


@pytest.fixture(scope="module")
def engine(qwen2_dir, tokenizer):
    import portagrpo.rollout.vllm_cpu_push as parts
    from portagrpo.rollout.vllm import VLLMRollout

    patch = pytest.MonkeyPatch()
    patch.setattr(parts, "PLAIN_GEMM_MAX_BYTES", MIXED_LIMIT)
    try:
        built = VLLMRollout(None, tokenizer, None, model_path=str(qwen2_dir), dtype="float32", max_model_len=256,
                            tied_embeddings=True, sleep_mode=False)
    finally:
        patch.undo()
    return built  # kept, as every module's engine is: vLLM's teardown of a collected engine is process-wide


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


def _gap(engine, policy) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 60, (4, 12), generator=torch.Generator().manual_seed(5))
    sampled = engine.generate(ids, torch.ones_like(ids), SamplingParams(8, 1.0))
    with torch.no_grad():
        logits = policy(input_ids=torch.cat([ids, sampled.responses], dim=1)).logits.float()
    ours = torch.log_softmax(logits[:, ids.shape[1] - 1:-1], dim=-1).gather(
        2, sampled.responses.unsqueeze(2)).squeeze(2)
    mask = sampled.mask.bool()
    return sampled.logp[mask], ours[mask]


def _perturb(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_small_layers_compute_on_their_weights_and_later_pushes_copy_straight_into_vllms(engine, policy):
    gemms = engine.in_place
    assert gemms is not None, "vLLM's CPU build was not recognised: the push went another way"
    assert gemms.plain_layers and gemms.gemm_layers, (len(gemms.plain_layers), len(gemms.gemm_layers))
    assert engine.update_weights(policy.state_dict().items()) > 0
    assert gemms.plan is not None, "vLLM's loader did something a direct copy cannot repeat"
    calls = []
    loader = gemms.model.load_weights
    gemms.model.load_weights = lambda weights: calls.append(1) or loader(weights)
    try:
        _perturb(policy, 1)
        engine.update_weights(policy.state_dict().items())
    finally:
        gemms.model.load_weights = loader
    assert not calls, "a later push went through vLLM's loader"
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer just after a direct push")


def test_the_sampler_follows_pushes_and_only_pushes(engine, policy):
    engine.update_weights(policy.state_dict().items())
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer just after a push")
    _perturb(policy, 2)
    gap = relative_error(*_gap(engine, policy))
    assert gap > 100 * tolerance(torch.float32, "logprob"), f"the engine follows an unpushed update ({gap:.2e})"
    engine.update_weights(policy.state_dict().items())
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer after pushing the update")


def test_weights_written_but_not_prepared_again_leave_the_prepared_gemms_on_the_old_ones(engine, policy):
    engine.update_weights(policy.state_dict().items())
    _perturb(policy, 3)
    named = [(n, t) for n, t in policy.state_dict().items() if n != "lm_head.weight"]
    engine.in_place.write(named)  # the kept weights, and so the F.linear layers, are new; the prepared GEMMs are not
    gap = relative_error(*_gap(engine, policy))
    assert gap > 100 * tolerance(torch.float32, "logprob"), f"the prepared GEMMs are not the ones in use ({gap:.2e})"
    engine.in_place.prepare()
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer once the GEMMs are prepared")

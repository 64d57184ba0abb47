"""Checks of the simulated Ascend that need its device in their own process. Run as
`python sim_checks.py NAME` under tests/emulated/npu_sim_env.py's environment; prints ok."""
import sys

import torch
import torch_npu  # noqa: F401 - the stand-in

from portagrpo.backends import get_backend

backend = get_backend("npu")
DEV = backend.device(0)
fused = torch_npu.npu_fusion_attention


def _sdpa(q, k, v, mask_allowed):
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask_allowed)


def fusion_attention_semantics():
    """The stand-in against plain sdpa: layouts, GQA by head ratio, True = masked, causal sparse modes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g),
               torch.randn(2, 2, 7, 8, generator=g))
    qd, kd, vd = q.to(DEV), k.to(DEV), v.to(DEV)
    compressed = torch.ones(2048, 2048, dtype=torch.bool, device=DEV).triu(1)
    bottom_right = torch.ones(5, 7, dtype=torch.bool).tril(2)
    top_left = torch.ones(5, 7, dtype=torch.bool).tril(0)
    scale = 8 ** -0.5
    for mode, allowed in ((3, bottom_right), (2, top_left)):
        out = fused(qd, kd, vd, 4, "BNSD", atten_mask=compressed, scale=scale, sparse_mode=mode)[0].cpu()
        assert torch.allclose(out, _sdpa(q, k, v, allowed), atol=1e-5), mode
    dense = fused(qd, kd, vd, 4, "BNSD", atten_mask=(~bottom_right).to(DEV), scale=scale)[0].cpu()
    assert torch.allclose(dense, _sdpa(q, k, v, bottom_right), atol=1e-5)
    full = fused(qd, kd, vd, 4, "BNSD", scale=scale)[0].cpu()  # no mask: full attention
    assert torch.allclose(full, _sdpa(q, k, v, None), atol=1e-5)
    bsnd = fused(qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2), 4, "bsnd", atten_mask=compressed,
                 scale=scale, sparse_mode=3)[0].cpu()
    assert torch.allclose(bsnd.transpose(1, 2), _sdpa(q, k, v, bottom_right), atol=1e-5)
    outs = fused(qd, kd, vd, 4, "BNSD", atten_mask=compressed, scale=scale, sparse_mode=3)
    assert len(outs) == 7 and outs[1].shape == (2, 4, 5, 8) and outs[1].dtype == torch.float32
    for call, words in ((lambda: fused(qd, kd, vd, 4, "BNSD", atten_mask=(~bottom_right).to(DEV), sparse_mode=3),
                         "compressed atten_mask"),
                        (lambda: fused(qd, kd[:, :1].expand(2, 3, 7, 8), vd[:, :1].expand(2, 3, 7, 8), 4, "BNSD"),
                         "Nq/Nkv must be a non-zero integer"),
                        (lambda: fused(qd, kd.half(), vd, 4, "BNSD"), "share one dtype"),
                        # the documented shape limits (head dim 1..768 with Dq = Dk >= Dv, Nq 1..256, K and V alike)
                        (lambda: fused(*(torch.zeros(1, 1, 2, 769, device=DEV),) * 3, 1, "BNSD"), "Dq = Dk >= Dv"),
                        (lambda: fused(qd, kd[..., :4].contiguous(), vd[..., :4].contiguous(), 4, "BNSD"),
                         "Dq = Dk >= Dv"),
                        (lambda: fused(qd, kd, vd[:, :, :3].contiguous(), 4, "BNSD"), "key and value must have one"),
                        (lambda: fused(torch.zeros(1, 257, 2, 8, device=DEV), kd[:1, :1, :2], vd[:1, :1, :2], 257,
                                       "BNSD"), "Nq must be in [1, 256]"),
                        (lambda: fused(qd[0, 0], kd[0, 0], vd[0, 0], 4, "BSH"), "3 or 4 dimensional")):
        try:
            call()
        except RuntimeError as err:
            assert words in str(err), str(err)
        else:
            raise AssertionError(f"accepted: {words}")
    torch.manual_seed(0)
    a = fused(qd, kd, vd, 4, "BNSD", scale=scale, keep_prob=0.5)[0].cpu()
    torch.manual_seed(0)
    b = fused(qd, kd, vd, 4, "BNSD", scale=scale, keep_prob=0.5)[0].cpu()
    assert torch.equal(a, b) and not torch.allclose(a, full, atol=1e-3)  # dropout from the device generator


def adapter_in_a_gqa_model_under_autocast():
    """backends/npu.py's adapter on the simulated op, bf16 autocast, GQA: logits as sdpa's, and the
    op given K/V with their own heads and the compressed causal mask (sparse_mode 3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.backends.npu import NPU_ATTENTION

    seen = []

    def recording(query, key, value, head_num, layout, **kwargs):
        seen.append((head_num, key.shape[1], tuple(kwargs["atten_mask"].shape), kwargs.get("sparse_mode", 0)))
        return fused(query, key, value, head_num, layout, **kwargs)

    torch_npu.npu_fusion_attention = recording
    assert backend.attention_implementation("auto", torch.bfloat16) == NPU_ATTENTION  # registers the adapter
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(3, 50, (2, 7), device=DEV)
    with torch.no_grad(), backend.autocast(torch.bfloat16):
        ref = model(input_ids=ids).logits.float().cpu()
        model.config._attn_implementation = NPU_ATTENTION
        out = model(input_ids=ids).logits.float().cpu()
    assert (out - ref).norm() / ref.norm() < 2e-2
    assert seen and all(s == (4, 2, (2048, 2048), 3) for s in seen), seen


def one_step_off_on_a_second_device():
    """rollout.mode=one_step_off on a simulated node of 2 NPUs (PORTAGRPO_NPU_SIM_DEVICES=2), one rank: the
    trainer on npu:0, its sampler process on npu:1 with the backend's attention (npu_fusion, registered
    in that process too), two steps sampled there."""
    import tempfile

    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    assert backend.device_count() == 2
    assert backend.attention_implementation("auto", torch.float32) == "npu_fusion"
    cfg = load_config(None, ["trainer.device=npu", "rollout.mode=one_step_off", "rollout.devices=1",
                             "trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4",
                             "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "data.train_size=32",
                             "trainer.test_freq=0", "trainer.save_freq=0", "data.max_response_length=8",
                             "trainer.tensorboard=false", "trainer.plot=false", "reward.num_workers=0"])
    with tempfile.TemporaryDirectory() as run:
        trainer = Trainer(cfg, run_dir=run, log=lambda m: None).setup()
        try:
            assert str(next(trainer.models.policy.parameters()).device) == "npu:0"
            assert trainer.parts.sampler.device == "npu:1", trainer.parts.sampler.device
            outs = [trainer.step() for _ in range(2)]
        finally:
            trainer.close()
    assert [o.metrics["rollout_staleness"] for o in outs] == [0, 1]
    assert all(o.metrics["response_len_mean"] > 0 for o in outs)
    from portagrpo.errors import UserError

    try:
        backend.sampler_process_device(0, 2, 2)  # two ranks and two samplers need four devices
    except UserError as err:
        assert "needs 4 npu devices per node" in str(err), str(err)
    else:
        raise AssertionError("two ranks with samplers were placed on a node of two devices")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")

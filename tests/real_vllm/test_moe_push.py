"""A tiny Qwen3-MoE (4 experts, top-2) pushed into real vLLM's CPU build: the packed experts go under a hub
checkpoint's per-expert names (model/moe.py: per_expert_names) and vLLM's CPU experts are packed again into their
kernel layout after every push (rollout/vllm_cpu_push.py: CpuGemmWeights.pack_experts). Without that repack the
engine computes with the dummy weights it was built from: the step-1 gap issue 43 saw.
- just after a push the sampler's log-probs equal the trainer's (fp32), through vLLM's loader and the direct copy;
- after an update of the experts alone that was not pushed they differ, and equal again once it is pushed;
- a push that skips the repack leaves a gap of whole hundredths of a nat."""
from __future__ import annotations

import os

import pytest
import torch
from test_cpu_push import _gap  # sampler log-probs against the policy's over the same sampled tokens

from portagrpo.tolerances import assert_close, relative_error, tolerance

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    from portagrpo.config import ModelConfig, TinyModelConfig
    from portagrpo.model.loading import build_tiny_model

    path = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny_model(ModelConfig(tiny=TinyModelConfig(moe="qwen3_moe")), tokenizer, 7).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(moe_dir, tokenizer, qwen2_dir):
    """Built after a dense engine in this process, whatever ran before: vLLM makes its model-parallel groups once per
    process, for the first engine's model (a dense one's have no expert-parallel group); the engine makes them
    again for its own (rollout/vllm_parallel.py: fresh_model_parallel_groups)."""
    from portagrpo.rollout.vllm import VLLMRollout

    kept.append(VLLMRollout(None, tokenizer, None, model_path=str(qwen2_dir), dtype="float32", max_model_len=256,
                            tied_embeddings=True, sleep_mode=False))
    return VLLMRollout(None, tokenizer, None, model_path=str(moe_dir), dtype="float32", max_model_len=256,
                       tied_embeddings=True, sleep_mode=False)


kept: list = []  # the dense engine stays: vLLM's teardown of a collected engine is process-wide


@pytest.fixture(scope="module")
def policy(moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _perturb_experts(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".experts." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def test_the_packed_experts_push_under_per_expert_names_and_are_repacked(engine, policy):
    from portagrpo.model.expert_packing import per_expert_names

    gemms = engine.in_place
    assert gemms is not None and len(gemms.expert_layers) == 2, "vLLM's CPU experts were not found"
    names = dict(per_expert_names(policy.state_dict().items()))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and not any(n.endswith("gate_up_proj")
                                                                             for n in names)
    assert engine.update_weights(policy.state_dict().items()) > 0
    assert gemms.plan is not None, "vLLM's loader did something a direct copy cannot repeat"
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer just after the first push")


def test_an_expert_update_shows_until_pushed(engine, policy):
    _perturb_experts(policy, 1)
    stale = relative_error(*_gap(engine, policy))
    assert stale > 10 * tolerance(torch.float32, "logprob"), stale
    engine.update_weights(policy.state_dict().items())  # the direct copy, then the repack
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer after pushing the experts")


def test_a_push_without_the_repack_is_the_step_1_gap(engine, policy):
    gemms = engine.in_place
    _perturb_experts(policy, 2)
    packer = gemms.pack_experts
    gemms.pack_experts = lambda: None
    try:
        engine.update_weights(policy.state_dict().items())
        sampler, trainer = _gap(engine, policy)
    finally:
        gemms.pack_experts = packer
    assert (sampler - trainer).abs().mean() > 1e-3
    engine.update_weights(policy.state_dict().items())
    assert_close(*_gap(engine, policy), torch.float32, "logprob", "sampler vs trainer once repacked")


def test_r3_is_refused_with_vllms_own_reason_on_its_cpu_build(moe_dir, tokenizer):
    """vLLM's CPU build cannot return routed experts (its capture is wired to the GPU model runners): asked for them
    (actor.router_replay=R3), the engine refuses in one sentence that carries vLLM's reason."""
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm import VLLMRollout

    with pytest.raises(UserError, match=r"router_replay=R3 needs vLLM to return .* this vLLM build refused "
                                        r"\(AuxOutput Connector requires Model Runner V2") as err:
        VLLMRollout(None, tokenizer, None, model_path=str(moe_dir), dtype="float32", max_model_len=256,
                    tied_embeddings=True, sleep_mode=False, route_layers=[0, 1], top_k=2, routes_required=True)
    assert "\n" not in str(err.value)


def test_without_replay_the_cpu_build_is_built_again_without_routes(moe_dir, tokenizer):
    """Router replay off: the engine asks for routed experts (for moe/route_agreement) and, refused by the CPU build,
    builds the engine without them; the run goes on with no route agreement to log."""
    from portagrpo.rollout.vllm import VLLMRollout

    engine = VLLMRollout(None, tokenizer, None, model_path=str(moe_dir), dtype="float32", max_model_len=256,
                         tied_embeddings=True, sleep_mode=False, route_layers=[0, 1], top_k=2)
    assert engine.route_layers is None and engine.llm is not None


def test_expert_parallel_shards_push_into_vllm_as_its_layout(tmp_path, moe_dir):
    """Issue 53 item 3: two CPU ranks train the tiny Qwen3-MoE under trainer.parallel=ep (each holds 2 of each
    layer's 4 experts) and push into real vLLM (an engine a rank): the push gathers each packed expert tensor from
    both ranks' shards and sends it under the per-expert names vLLM's loader takes, so after every push the sampler's
    log-probs equal the trainer's to fp32 rounding, step after step (a wrong expert block would be whole hundredths
    of a nat off, as test_a_push_without_the_repack_is_the_step_1_gap shows)."""
    pytest.importorskip("torchtitan", reason="trainer.parallel=ep needs portagrpo[ep] (ci/vllm-cpu-leg.sh installs it)")
    from test_vllm_rollout import _sampler_matches_trainer, _train

    rows = _train(tmp_path / "run", f"model.path={moe_dir}", "trainer.total_steps=2", "trainer.nproc_per_node=2",
                  "trainer.parallel=ep", "actor.router_replay=null")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        _sampler_matches_trainer(row)


def test_vllms_expert_parallelism_is_refused_on_its_cpu_build_in_one_sentence(tmp_path, moe_dir):
    """vLLM's CPU build takes enable_expert_parallel and then its MoE kernel reads global expert ids into a rank's local
    experts (a segmentation fault at the engine's first forward, measured with TP 2): the CPU row refuses
    rollout.expert_parallel_size before vLLM is built, naming the key (backends/cpu.py `vllm_expert_parallel`)."""
    from test_vllm_rollout import _cli

    res = _cli(tmp_path / "run", f"model.path={moe_dir}", "trainer.total_steps=1", "trainer.nproc_per_node=2",
               "rollout.expert_parallel_size=2", "rollout.data_parallel_size=2")
    assert res.returncode != 0 and "Segmentation fault" not in res.stderr, res.stderr[-3000:]
    assert "rollout.expert_parallel_size=2: vLLM's build for --device cpu cannot split the experts" in res.stderr, \
        res.stderr[-3000:]


def test_the_cpu_builds_expert_parallelism_stops_as_its_row_says(tmp_path, moe_dir):
    """What the CPU row's refusal stands on, pinned against the installed vllm-cpu: two ranks under the external
    launcher build the tiny Qwen3-MoE at tensor-parallel 2 with enable_expert_parallel, and a rank dies of a
    segmentation fault (its MoE kernel reads global expert ids into the rank's 2 local experts). When a vllm-cpu release
    survives this, the test fails, and the row (backends/cpu.py `vllm_expert_parallel`) can be reconsidered."""
    import subprocess
    import sys
    from pathlib import Path

    # vLLM's CPU communicator names its shared-memory segments after the group alone under the external launcher
    # (cpu_worker.py sets VLLM_DIST_IDENT from the init method); a rank that dies leaves them in /dev/shm, where the
    # next tensor-parallel engine on this machine fails to create its own ("errno: 17"): the probe removes what it left
    before = set(Path("/dev/shm").glob("*cpushm*"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                              "127.0.0.1", "--master_port", "29541", str(Path(__file__).with_name("ep_cpu_probe.py")),
                              str(moe_dir)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    finally:
        for leftover in set(Path("/dev/shm").glob("*cpushm*")) - before:
            leftover.unlink(missing_ok=True)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "EP-SURVIVED" not in out, out[-3000:]
    assert "exitcode: -11" in out or "Segmentation fault" in out or "SIGSEGV" in out, out[-3000:]

"""Expert parallelism (trainer.parallel=ep, issue 53) on gloo CPU ranks: the experts of every MoE layer split over the
ranks (torchtitan's all-to-all dispatcher under transformers' block) train exactly as one process holding every
expert, in fp64, with router replay R3 on sampled rollouts too; the expert tensors keep their names, so the full
state is the one-process state."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_moe_ranks import run_worker

from portagrpo.backends.fsdp_compat import fsdp2_problem
from portagrpo.model.expert_parallel import ep_import_problem

pytestmark = [pytest.mark.skipif(ep_import_problem() is not None, reason=str(ep_import_problem())),
              pytest.mark.skipif(fsdp2_problem(torch.float64) is not None, reason="FSDP2 refused on this torch")]
HERE = Path(__file__).resolve().parent
KEYS = ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "entropy", "pg_clipfrac")


def assert_same_run(one: dict, other: dict, keys=KEYS, rel: float = 1e-10) -> None:
    for m1, m2 in zip(one["metrics"], other["metrics"], strict=True):
        for key in keys:
            if key in m1:
                assert m2[key] == pytest.approx(m1[key], rel=rel, abs=1e-12), key
    assert one["state"].keys() == other["state"].keys()
    for name, p1 in one["state"].items():
        err = float((other["state"][name].double() - p1.double()).norm() / p1.double().norm().clamp(min=1e-30))
        assert err < rel, name


def split_experts(result: dict, experts: int, per_rank: int) -> None:
    packed = {n: v for n, v in result["placement"].items() if ".experts." in n}
    assert packed, result["placement"]
    assert result["placement"]["_rows"]  # the sharded load reads each rank's block where the rank holds it
    for name, (full, local, placement) in packed.items():
        assert full[0] == experts and local[0] == per_rank and "Shard(dim=0)" in placement, (name, placement)


def test_two_ep_ranks_train_as_one_process_in_fp64(tmp_path):
    """2 steps, 2 epochs a step: each rank holds 2 of the 4 experts of every layer, its tokens cross to the other
    rank's experts and back; metrics and the whole final state equal one process's to fp64 rounding."""
    one = run_worker(tmp_path / "one", 1, "fp64", "fixed")
    ep = run_worker(tmp_path / "ep", 2, "fp64", "fixed", "ep")
    assert_same_run(one, ep)
    split_experts(ep, 4, 2)
    assert one["metrics"][1]["loss_policy"] != one["metrics"][0]["loss_policy"]


def test_router_replay_r3_under_ep_equals_fsdp2_and_ep1(tmp_path):
    """Sampled rollouts (the hf engine, every generate forward an all-to-all in lockstep) with R3, 3 steps: the replayed
    routes reach the experts on whichever rank holds them, so EP=2 trains as EP=1 does (trainer.ep_size=1: each rank
    holding every expert) and as FSDP2 does, with the same route agreement (issue 53's bar, in fp64)."""
    fsdp2 = run_worker(tmp_path / "fsdp2", 2, "fp64", "hf", "fsdp2", "steps=3")
    ep1 = run_worker(tmp_path / "ep1", 2, "fp64", "hf", "ep", "trainer.ep_size=1", "steps=3")
    ep = run_worker(tmp_path / "ep", 2, "fp64", "hf", "ep", "steps=3")
    for other in (fsdp2, ep1):
        assert_same_run(other, ep, keys=(*KEYS, "moe/route_agreement", "rollout_corr/kl"))
    assert len(ep["metrics"]) == 3 and all(m["moe/route_agreement"] > 0.5 for m in ep["metrics"])
    split_experts(ep, 4, 2)
    split_experts(ep1, 4, 2)  # EP=1: FSDP2 over efsdp splits each rank's (every) expert block, as under fsdp2


@pytest.mark.slow
def test_four_ranks_as_two_expert_groups_of_two(tmp_path):
    """trainer.ep_size=2 on 4 ranks: two expert-parallel groups (ranks 0-1, 2-3), each expert held by 2 ranks that
    shard it with FSDP2 (efsdp): still one process's run."""
    one = run_worker(tmp_path / "one", 1, "fp64", "fixed")
    ep = run_worker(tmp_path / "ep", 4, "fp64", "fixed", "ep", "trainer.ep_size=2")
    assert_same_run(one, ep)
    split_experts(ep, 4, 1)  # 2 experts per ep rank, halved again over efsdp


def test_a_rank_whose_experts_get_no_token_still_joins_the_backward(tmp_path):
    """Module level, fp64: in layer 0 every route of both ranks points at rank 1's experts, so rank 0's experts get no
    token (transformers' eager loop then returns zeros cut off from the graph: before the fix rank 0 skipped both
    all-to-alls in its backward and the ranks hung). Loss and every gradient equal the unsplit model's over both
    batches, and the ids that reached the experts are the replayed routes, including those held by the other rank."""
    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "ep_block_worker.py"),
                          str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = torch.load(tmp_path / "result.pt", weights_only=False)
    assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-13)
    assert out["worst"] < 1e-12 and out["reached"] and out["local_experts"] == [2, 2]


def test_a_deepseek_v3_shaped_model_trains_three_steps_under_ep_as_one_process(tmp_path):
    """DeepSeek-V3's shape (latent attention, a dense first layer, a shared expert, a sigmoid router choosing within
    the best of 2 expert groups, weights scaled by 2.5), 3 steps in fp64: EP=2 equals one process. Its grouped router
    sends whole batches to one rank's experts, the case the test above isolates."""
    one = run_worker(tmp_path / "one", 1, "fp64", "fixed", "fsdp2", "model.tiny.moe=deepseek_v3", "steps=3")
    ep = run_worker(tmp_path / "ep", 2, "fp64", "fixed", "ep", "model.tiny.moe=deepseek_v3", "steps=3")
    assert_same_run(one, ep)
    split_experts(ep, 4, 2)


def test_deepseek_v3_with_r3_under_ep_equals_fsdp2_and_ep1(tmp_path):
    """Sampled rollouts with R3 on the DeepSeek-V3-shaped model, 3 steps: its sigmoid router's replayed weights are
    its own (model/router_replay.py), and EP=2 trains as EP=1 (every rank holding every expert) and FSDP2 do."""
    fsdp2 = run_worker(tmp_path / "fsdp2", 2, "fp64", "hf", "fsdp2", "model.tiny.moe=deepseek_v3", "steps=3")
    ep1 = run_worker(tmp_path / "ep1", 2, "fp64", "hf", "ep", "trainer.ep_size=1", "model.tiny.moe=deepseek_v3",
                     "steps=3")
    ep = run_worker(tmp_path / "ep", 2, "fp64", "hf", "ep", "model.tiny.moe=deepseek_v3", "steps=3")
    for other in (fsdp2, ep1):
        assert_same_run(other, ep, keys=(*KEYS, "moe/route_agreement"))
    assert len(ep["metrics"]) == 3 and all(m["moe/route_agreement"] == 1.0 for m in ep["metrics"])


def _train_and_export(out: Path, parallel: str, family: str) -> tuple[Path, str]:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(out),
           "trainer.nproc_per_node=2", f"trainer.parallel={parallel}", "trainer.total_steps=1", "trainer.save_freq=1",
           "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false",
           "data.train_size=16", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
           "actor.micro_batch_size=2", "rollout.engine=fixed", "data.max_response_length=8",
           f"model.tiny.moe={family}"]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from portagrpo.tools.export import export

    return export(out, out / "export", log=lambda m: None), res.stdout + res.stderr


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_hugging_face_checkpoint_loads_by_expert_shards_and_exports_for_transformers(tmp_path, family):
    """The run's initial model is a Hugging Face checkpoint as transformers 5 saves it (one tensor per expert, the
    hub's names); under EP each rank reads only its own experts' tensors from it (model/sharded_load.py), trains a step,
    writes its shards, and `portagrpo export` gives a directory transformers loads alone, equal to FSDP2's run."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ep, log = _train_and_export(tmp_path / "ep", "ep", family)
    fsdp2, _ = _train_and_export(tmp_path / "fsdp2", "fsdp2", family)
    assert "loaded whole" not in log, log[-2000:]
    with safe_open(str(tmp_path / "ep" / "init_model" / "model.safetensors"), framework="pt") as f:
        assert any(".experts.0.gate_proj.weight" in k for k in f.keys())  # the hub's per-expert layout
    model = AutoModelForCausalLM.from_pretrained(ep)
    want = AutoModelForCausalLM.from_pretrained(fsdp2).state_dict()
    assert model.config.model_type == family
    state = model.state_dict()
    assert state.keys() == want.keys()
    for name, value in want.items():
        err = float((state[name].double() - value.double()).norm() / value.double().norm().clamp(min=1e-30))
        assert err < 1e-5, (name, err)  # fp32: the all-to-all sums in another order than FSDP2's gathered experts
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize("parallel", ["ep", "fsdp2"])
def test_the_push_sends_experts_one_at_a_time_to_the_ranks_whose_engine_keeps_them(tmp_path, parallel):
    """Issue 53 item 3: the weight push to vLLM never gathers a packed expert tensor whole (model/parallel.py
    push_pairs). Experts go from a rank that holds them to the ranks whose engine keeps them, under a hub checkpoint's
    per-expert names, equal to the gathered state's. Where the engines' layout is the trainer's (rank r's engine keeps
    the r-th block of experts, vLLM's linear placement, and rank r holds it), no collective runs for the experts at
    all; where experts cross ranks, one broadcast carries a holder's consecutive experts (2 layers x gate_up and down x
    2 holders)."""
    result = run_worker(tmp_path / parallel, 2, "fp64", "fixed", parallel, "steps=1", "push=1")
    layers, block = 2, 2  # 2 MoE layers of 4 experts; rank r holds experts 2r, 2r + 1
    for rank, push in enumerate(result["push"]):
        for layout, seen in push.items():
            assert seen["equal"], (rank, layout)
            assert seen["whole"] == 0, (rank, layout)  # no packed tensor gathered whole
            assert seen["largest"] == 64 * 64, (rank, layout)  # one expert's gate, up or down [64, 64], not [4, ...]
        assert push["own"]["broadcasts"] == 0  # the experts: none sent by collective (nor anything else)
        assert push["other"]["broadcasts"] == push["every"]["broadcasts"] == layers * 2 * 2
        assert push["every"]["names"] - push["own"]["names"] == layers * block * 3


@pytest.mark.parametrize("parallel", ["ep", "fsdp2"])
def test_a_sampler_copy_of_a_sharded_moe_policy_takes_the_packed_experts_whole(tmp_path, parallel):
    """The hf engine's sampler copy (rollout.precision=fp32) loads transformers' own names, so its push gathers the
    packed experts whole, as before the per-expert push for vLLM (a per-expert name would not be in its model): two
    steps train, the second after a push."""
    result = run_worker(tmp_path / parallel, 2, "fp32", "hf", parallel, "rollout.precision=fp32", "steps=2")
    assert len(result["metrics"]) == 2 and all(m["loss_policy"] == m["loss_policy"] for m in result["metrics"])

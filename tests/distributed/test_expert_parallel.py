"""Expert parallelism (trainer.parallel=ep, issue 53) on gloo CPU ranks: the experts of every MoE layer split over the
ranks (torchtitan's all-to-all dispatcher under transformers' block) train exactly as one process holding every
expert, in fp64, with router replay R3 on sampled rollouts too; the expert tensors keep their names, so the full
state is the one-process state."""
import pytest
import torch
from test_moe_ranks import run_worker

from portagrpo.backends.fsdp_compat import fsdp2_problem
from portagrpo.model.expert_parallel import ep_import_problem

pytestmark = [pytest.mark.skipif(ep_import_problem() is not None, reason=str(ep_import_problem())),
              pytest.mark.skipif(fsdp2_problem(torch.float64) is not None, reason="FSDP2 refused on this torch")]
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


def test_router_replay_r3_under_ep_equals_fsdp2(tmp_path):
    """Sampled rollouts (the hf engine, every generate forward an all-to-all in lockstep) with R3: the replayed routes
    reach the experts on whichever rank holds them, so EP trains as FSDP2 does, with the same route agreement."""
    fsdp2 = run_worker(tmp_path / "fsdp2", 2, "fp64", "hf", "fsdp2")
    ep = run_worker(tmp_path / "ep", 2, "fp64", "hf", "ep")
    assert_same_run(fsdp2, ep, keys=(*KEYS, "moe/route_agreement", "rollout_corr/kl"))
    assert all(m["moe/route_agreement"] > 0.5 for m in ep["metrics"])
    split_experts(ep, 4, 2)


@pytest.mark.slow
def test_four_ranks_as_two_expert_groups_of_two(tmp_path):
    """trainer.ep_size=2 on 4 ranks: two expert-parallel groups (ranks 0-1, 2-3), each expert held by 2 ranks that
    shard it with FSDP2 (efsdp): still one process's run."""
    one = run_worker(tmp_path / "one", 1, "fp64", "fixed")
    ep = run_worker(tmp_path / "ep", 4, "fp64", "fixed", "ep", "trainer.ep_size=2")
    assert_same_run(one, ep)
    split_experts(ep, 4, 1)  # 2 experts per ep rank, halved again over efsdp

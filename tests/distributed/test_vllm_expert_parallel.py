"""vLLM's expert parallelism for rollouts (rollout.expert_parallel_size, rollout.data_parallel_size; issue 53 item 3)
on 2 CPU ranks, vLLM played by tests/standins/fake_vllm.py (one instance over the world, whole experts per rank in the
linear placement, other ranks' experts skipped by the loader, tokens that depend on every rank's experts, data-
parallel ranks in step). vLLM's CPU build cannot run it (rollout/vllm_parallel.py ExpertLayout, docs/backends.md)."""
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.backends.fsdp_compat import fsdp2_problem
from portagrpo.model.expert_parallel import ep_import_problem

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_tensor_parallel import two_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(fsdp2_problem(torch.float32) is not None, reason="FSDP2 refused on this torch")


def _ranks(tmp_path, parallel: str, how: str = "right", layout: str = "dp") -> list[dict]:
    return two_ranks("vllm_ep_worker.py", tmp_path / f"{parallel}-{how}-{layout}", parallel, how, layout)


@pytest.mark.parametrize("parallel, layout", [
    ("fsdp2", "dp"), ("fsdp2", "tp"),
    pytest.param("ep", "dp", marks=pytest.mark.skipif(ep_import_problem() is not None,
                                                      reason=str(ep_import_problem())))])
def test_each_engine_receives_its_own_experts_and_r3_replays_the_routes(tmp_path, parallel, layout):
    """Both ranks run one vLLM instance with its experts split (enable_expert_parallel), as two engines joined by data
    parallelism (data_parallel_size=2: each rank samples its own prompts) or as one engine of tensor-parallel 2 (its
    ranks sample the group's prompts together): rank r's engine is given experts 2r and 2r + 1 of every layer at
    every push, and nothing else of the experts; R3 replays the routes vLLM chose (global expert ids) with agreement
    1 (fp32 on both sides, the same weights). Under trainer.parallel=ep rank r holds those same experts, and so does
    FSDP2 over 2 ranks (its dim-0 shards of [4, ...] are the same blocks), so the pushes run no collective for the
    experts: each rank sends its engine its own shard's rows (tests/distributed/test_expert_parallel.py covers a
    layout where they cross ranks)."""
    ranks = _ranks(tmp_path, parallel, layout=layout)
    for rank, seen in enumerate(ranks):
        assert "error" not in seen, seen
        assert seen["calls"] == ([True, 2, 1] if layout == "dp" else [True, 1, 2])
        mine = [str(2 * rank), str(2 * rank + 1)]
        assert seen["pushed"] and all(pushed == mine for pushed in seen["pushed"]), seen["pushed"]
        assert seen["held"] == mine
        assert all(a is not None and a >= 0.99 for a in seen["agreement"]), seen["agreement"]
    assert [seen["broadcasts"] for seen in ranks] == [0, 0]


def test_a_push_in_another_layout_than_vllms_leaves_experts_unloaded_and_the_stand_in_refuses(tmp_path):
    """The stand-in's check that makes the test above able to fail: when the push follows another layout than vLLM's
    (rank r sent the other rank's experts), vLLM's loader skips all of them and would sample with the dummy weights of
    its own; the stand-in refuses at the first generate."""
    ranks = _ranks(tmp_path, "fsdp2", "wrong")
    assert all("not loaded (this rank's expert)" in seen.get("error", "") for seen in ranks), ranks

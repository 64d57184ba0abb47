"""One rank of the vLLM expert-parallelism check (run by portagrpo.launcher with 2 ranks): the stand-in of
tests/standins/fake_vllm.py plays a GPU build of vLLM 0.23 (routes on every rank), one vLLM instance over both ranks
with its experts split over them (rollout.expert_parallel_size=2: each rank's engine holds 2 of each layer's 4
experts): LAYOUT=dp, two engines joined by vLLM's data parallelism (rollout.data_parallel_size=2), or LAYOUT=tp, one
engine of tensor-parallel 2, the policy the tiny Qwen3-MoE with actor.router_replay=R3, trained under
trainer.parallel=PARALLEL. With HOW=wrong the engine asks the push for the other rank's experts (a layout that
disagrees with vLLM's), to show that the stand-in then refuses to sample. Writes rank<R>.json: the route agreement of
2 steps, the expert tensors each push gave this rank's engine, and the broadcasts the pushes ran for experts; or the
error that stopped the rank.
Usage: vllm_ep_worker.py OUT PARALLEL HOW LAYOUT"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

from portagrpo.config import load_config  # noqa: E402
from portagrpo.errors import UserError  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402


def main() -> None:
    out, parallel, how, layout = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    fake_vllm.install()
    fake_vllm.FakeLLM.vllm = "0.23.0"
    import torch.distributed as dist

    from portagrpo.model import parallel as strategies
    from portagrpo.rollout import vllm_parallel

    if how == "wrong":
        vllm_parallel.ExpertLayout.wanted = lambda self, rank, experts: range((1 - rank) * experts // 2,
                                                                              (2 - rank) * experts // 2)
    counts = {"broadcasts": 0, "pushing": False}
    broadcast = dist.broadcast

    def counted(*args, **kwargs):
        counts["broadcasts"] += counts["pushing"]
        return broadcast(*args, **kwargs)

    dist.broadcast = counted
    full_tensors = strategies.FSDP2.full_tensors

    def pushing(self, scorer, wanted=None, per_expert=False):
        counts["pushing"] = True
        try:
            yield from full_tensors(self, scorer, wanted, per_expert)
        finally:
            counts["pushing"] = False

    strategies.FSDP2.full_tensors = pushing
    cfg = load_config(None, [
        "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.tensorboard=false",
        "trainer.plot=false", "data.train_size=32", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.max_response_length=8",
        "rollout.engine=vllm", "rollout.expert_parallel_size=2",
        "rollout.data_parallel_size=2" if layout == "dp" else "rollout.tensor_model_parallel_size=2",
        "rollout.vllm_weight_bucket_mb=0", "model.tiny.moe=qwen3_moe", "actor.router_replay=R3",
        f"trainer.parallel={parallel}", "trainer.device=cpu", "reward.num_workers=0"])
    rank = int(os.environ["RANK"])
    result: dict = {}
    try:
        trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
        rows = [trainer.step().metrics.row() for _ in range(2)]
        result["agreement"] = [row.get("moe/route_agreement") for row in rows]
        llm = fake_vllm.FakeLLM.instances[-1]
        result["pushed"] = [sorted({n.split(".experts.")[1].split(".")[0] for n in entry[1] if ".experts." in n})
                            for entry in llm.log if entry[0] == "reload"]
        result["held"] = sorted({n.split(".experts.")[1].split(".")[0] for n in llm.shards if ".experts." in n})
        result["broadcasts"] = counts["broadcasts"]
        result["calls"] = (llm.kwargs.get("enable_expert_parallel"), llm.kwargs.get("data_parallel_size"),
                           llm.kwargs.get("tensor_parallel_size"))
    except (UserError, AssertionError, RuntimeError) as err:
        result["error"] = f"{type(err).__name__}: {err}"
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a rank that stopped mid-generate leaves its peer's collectives half-open: no teardown


if __name__ == "__main__":
    main()

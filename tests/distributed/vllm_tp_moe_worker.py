"""One rank of the MoE tensor-parallel vLLM check (run by portagrpo.launcher with 2 ranks, TP 2): the stand-in of
tests/standins/fake_vllm.py plays vLLM RELEASE, the policy is the tiny Qwen3-MoE with actor.router_replay=MODE (R3,
or null: the route agreement logged only). With HOW=bypass the engine's refusal is switched off, to show what the
release does without it. Writes rank<R>.json: the two steps' route agreement, or the error that stopped the rank.
Usage: vllm_tp_moe_worker.py OUT RELEASE MODE HOW."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

from portagrpo.config import load_config  # noqa: E402
from portagrpo.errors import UserError  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402


def main() -> None:
    out, release, mode, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    fake_vllm.install()
    fake_vllm.FakeLLM.vllm = release
    if how == "bypass":
        import portagrpo.rollout.vllm as engine_module

        engine_module.routes_on_first_tp_rank_only = lambda vllm: False
    cfg = load_config(None, [
        "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.tensorboard=false",
        "trainer.plot=false", "data.train_size=32", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=8", "data.max_response_length=8",
        "rollout.engine=vllm", "rollout.tensor_model_parallel_size=2", "rollout.vllm_weight_bucket_mb=0",
        "model.tiny.moe=qwen3_moe", f"actor.router_replay={mode}", "trainer.device=cpu", "reward.num_workers=0"])
    rank = int(__import__("os").environ["RANK"])
    result: dict = {}
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
        rows = [trainer.step().metrics.row() for _ in range(2)]
        result["agreement"] = [row.get("moe/route_agreement") for row in rows]
    except (UserError, AssertionError, RuntimeError) as err:  # RuntimeError: a peer that stopped mid-collective
        result["error"] = f"{type(err).__name__}: {err}"
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    import os

    os._exit(0)  # a rank that stopped mid-generate leaves its peer's collectives half-open: no teardown


if __name__ == "__main__":
    main()

"""One rank of the tensor-parallel vLLM check (run by portagrpo.launcher with K ranks).

vLLM is the stand-in of tests/standins/fake_vllm.py, which forms TP groups from the launcher's ranks as
vLLM does. The rank trains two steps and validates with `rollout.engine=vllm` and
`rollout.tensor_model_parallel_size=TP`, then trains a third step (whose rollout reloads the weights
that validation's level-2 sleep discarded), and writes `rank<R>.pt`: what its engine was asked and answered
(the group's requests, seeds and tokens), what the trainer received back, and the weights its engine holds.
Usage: vllm_tp_worker.py OUT TP.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

from portagrpo.config import load_config  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402


def main() -> None:
    out, tp = Path(sys.argv[1]), int(sys.argv[2])
    fake_vllm.install()
    cfg = load_config(None, [
        "trainer.progress_bar=false", "trainer.test_freq=2", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.tensorboard=false", "trainer.plot=false", "data.train_size=64", "data.val_size=8",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=16", "rollout.engine=vllm",
        f"rollout.tensor_model_parallel_size={tp}", "rollout.vllm_weight_bucket_mb=0", "rollout.temperature=0.9",
        "model.tiny.hidden_size=32", "model.tiny.num_heads=4", "model.tiny.intermediate_size=64",
        "trainer.device=cpu"])
    trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
    engine = trainer.parts.engine
    returned = []
    generate = engine.generate

    def recording(prompt_ids, prompt_mask, params):
        sampled = generate(prompt_ids, prompt_mask, params)
        returned.append([[t for t, m in zip(row, mask) if m] for row, mask in
                         zip(sampled.responses.tolist(), sampled.mask.tolist())])
        return sampled

    engine.generate = recording
    metrics = [trainer.step().metrics for _ in range(2)]
    metrics.append(trainer.validate())
    metrics.append(trainer.step().metrics)
    llm, rank = engine.llm, trainer.runtime.comm.rank
    torch.save({"generate": [e[3:] for e in llm.log if e[0] == "generate"], "returned": returned,
                "loads": sum(len(e[1]) for e in llm.log if e[0] in ("load", "reload")), "tp_ranks": llm.tp_ranks,
                "per_request_draws": llm.per_request_draws, "host_bytes_peak": llm.host_bytes_peak,
                "shards": llm.shards, "engine_seed": llm.kwargs["seed"], "metrics": metrics,
                "full": {k: v.detach().clone() for k, v in trainer.models.policy.state_dict().items()}},
               out / f"rank{rank}.pt")
    trainer.close()


if __name__ == "__main__":
    main()

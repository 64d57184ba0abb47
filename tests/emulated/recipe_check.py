"""Run by portagrpo.launcher on two ranks of DEVICE (emu, or npu: the simulated Ascend): the shipped Qwen3-30B-A3B
recipe of that vendor, as written but for what two small ranks cannot hold (a tiny Qwen3-MoE policy instead of the
checkpoint, generated data, small batches, vLLM's tensor parallelism over the 2 ranks instead of 8), trains and
checkpoints TOTAL steps (with --resume: from the run's last checkpoint; a process forms its group once, so a resume
is a second launch). Its offload (actor.offload, ref_offload), FSDP2, R2 router replay,
KL loss, gradient checkpointing and, on the simulated Ascend, vLLM rollout (tests/standins/fake_vllm.py, playing
vllm-ascend 0.23) are the recipe's own; the emulated device's row has no vLLM, so it samples with the hf engine.
Prints RESULT {json} on rank 0: each step's losses, norms and route agreement."""
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "standins"))
import fake_vllm  # noqa: E402

device, recipe, out, total = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
resume = sys.argv[5:] == ["--resume"]
if device == "npu":
    fake_vllm.FakeLLM.ascend = "0.23.0"  # ci/matrix.yaml's npu-current: vllm-ascend 0.23 on vLLM 0.23
else:
    fake_vllm.FakeLLM.vllm = "0.33.0"  # the newest release read: routes on a TP group's first rank only
sys.modules.update(fake_vllm.modules())

import portagrpo.rollout.vllm as engine_module  # noqa: E402
from portagrpo.config import load_config  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402

# the distributions the engine's version check reads, as the release played would have them installed
release, ascend = fake_vllm.FakeLLM.release()
engine_module._installed = {"vllm": release, "vllm-ascend": ascend}.get

SMALL = ["model.path=null", "model.tiny.moe=qwen3_moe", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
         "data.task=repeat", "data.train_files=[]", "data.val_files=[]", "data.train_size=32", "data.val_size=4",
         "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=8", "rollout.n=2",
         "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "rollout.tensor_model_parallel_size=2",
         "reward.function=auto", "reward.num_workers=0", "trainer.nproc_per_node=2", "trainer.save_freq=2",
         "trainer.test_freq=0", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false",
         "trainer.host_memory_gb=null", "trainer.device_memory_gb=null", "model.dtype=fp32"]


def steps(total: int, resume: bool) -> list[dict]:
    # The emulated device's row has no vLLM. The simulated Ascend's device is registered from Python, where torch
    # offers no page-locked allocator for it (pin_memory raises "implement getPinnedMemoryAllocator"), so its
    # offloaded shards stay pageable; torch_npu registers one, which this cannot show.
    engine = ["actor.pin_offload=false"] if device == "npu" else ["rollout.engine=hf"]
    cfg = load_config(recipe, [*SMALL, *engine, f"trainer.device={device}", f"trainer.total_steps={total}"])
    trainer = Trainer(cfg, run_dir=out, resume=out if resume else None, log=lambda m: None).setup()
    try:
        return [report.row() for report in trainer.fit(progress=False)]  # checkpoints by trainer.save_freq
    finally:
        trainer.close()


rows = steps(total, resume)
if int(os.environ.get("RANK", "0")) == 0:
    keep = ("step", "loss_policy", "loss_kl", "grad_norm", "moe/route_agreement")
    print("RESULT " + json.dumps([{k: r[k] for k in keep if k in r} for r in rows]))
if torch.distributed.is_initialized():  # the trainer closes its group; nothing is left open either way
    torch.distributed.destroy_process_group()

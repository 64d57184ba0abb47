"""Run by portagrpo.launcher on RANKS emulated ranks: a Qwen3-MoE whose experts outweigh the rest (test_sharded_load's
MOE shape) trains 2 steps under trainer.parallel=ep (or fsdp2) with the vLLM engine, vLLM played by
tests/standins/fake_vllm.py as a GPU build of vLLM 0.23 on the emulated device (the device row is given vLLM here:
its own row has none), whose engine keeps what it is given on the device, so its weights count in the rank's bytes.
VLLM_EP=1: rollout.expert_parallel_size = every rank (each engine keeps its block of experts); 0: one engine a rank,
each keeping every expert. Prints RESULT {json} on rank 0: each step's push and rollout peaks (GiB a rank, the
largest over the ranks) and losses.
Usage: vllm_ep_push_check.py OUT PARALLEL VLLM_EP"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "standins"))
sys.path.insert(0, str(HERE))
import fake_vllm  # noqa: E402
from test_sharded_load import MOE, RUN  # noqa: E402

import portagrpo_emu.backend as emu  # noqa: E402

out, parallel, split = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
fake_vllm.FakeLLM.vllm = "0.23.0"
sys.modules.update(fake_vllm.modules())
emu.SPEC = replace(emu.SPEC, rollout_engines=(*emu.SPEC.rollout_engines, "vllm"))  # a GPU's vLLM, played

from portagrpo.config import load_config  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402

world = int(os.environ["WORLD_SIZE"])
ep = [f"rollout.expert_parallel_size={world}", f"rollout.data_parallel_size={world}"] if split else []
overrides = [o for o in RUN if not o.startswith(("trainer.parallel=", "rollout.engine=", "trainer.total_steps="))]
cfg = load_config(None, [*overrides, *MOE, *ep, "trainer.total_steps=2", f"trainer.parallel={parallel}",
                         "rollout.engine=vllm", "rollout.vllm_weight_bucket_mb=0", "trainer.device=emu",
                         f"trainer.nproc_per_node={world}", "reward.num_workers=0"])
trainer = Trainer(cfg, run_dir=out, log=lambda m: None).setup()
try:
    rows = [report.row() for report in trainer.fit(progress=False)]
finally:
    trainer.close()
if int(os.environ.get("RANK", "0")) == 0:
    keep = ("step", "loss_policy", "grad_norm", "mem/push_peak_gb", "mem/rollout_peak_gb", "mem/load_peak_gb")
    print("RESULT " + json.dumps([{k: r[k] for k in keep if k in r} for r in rows]))

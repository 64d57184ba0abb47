"""Run in a subprocess by tests/emulated/test_moe_devices.py on the simulated Ascend (--device npu) or the emulated
device (--device emu): the MoE parity stage with the backend's expert ops in fp32 and bf16, counting the vendor
top-k's calls, then a 2-step R3 run on 2 ranks (FSDP2 on npu, DDP on emu) whose sampler and trainer log-probs agree.
Prints one JSON line."""
import json
import sys
import tempfile

from portagrpo.backends import get_backend
from portagrpo.tolerances import relative_error
from portagrpo.tools import parity, parity_moe


def parity_errors(backend, calls: list[int]) -> dict[str, float]:
    """The MoE parity stage in fp32 and bf16 with the backend's expert ops, counting the vendor top-k's calls."""
    select = backend.moe_topk()
    if select is not None:
        def counted(logits, k):
            calls[0] += 1
            assert logits.device.type == backend.spec.device_type
            return select(logits, k)
        backend.moe_topk = lambda: counted
    errors = {}
    for dtype in ("fp32", "bf16"):
        tdtype = parity.DTYPES[dtype]
        setting = parity.Setting(backend.device(0), dtype, "chunked", lambda t=tdtype: backend.autocast(t),
                                 backend.spec.moe_experts, backend.moe_topk())
        got = parity_moe.moe_stages(parity.load_fixture(parity_moe.SCENARIO_FILE), setting, parity.OBJECTIVE,
                                    parity.TEMPERATURE)
        golden = parity.load_fixture(parity_moe.GOLDEN_FILE)
        errors.update({f"{dtype}:{k}": relative_error(v.detach().double().cpu(), golden[k]) for k, v in got.items()})
    return errors


def train_and_resume(device: str, parallel: str) -> dict:
    """A 2-step R3 run on 2 ranks under `parallel`, and its step-1 checkpoint resumed to step 2."""
    from portagrpo.cli import main as cli
    from portagrpo.metrics import MEASURED_KEYS

    args = ["--device", device, "trainer.nproc_per_node=2", f"trainer.parallel={parallel}",
            "trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "data.train_batch_size=2",
            "rollout.n=2", "data.train_size=8", "actor.ppo_mini_batch_size=4", "trainer.test_freq=0",
            "trainer.save_freq=1", "data.max_response_length=8", "model.tiny.moe=qwen3_moe", "actor.router_replay=R3"]
    with tempfile.TemporaryDirectory() as run, tempfile.TemporaryDirectory() as part:
        rc = cli(["train", "--output-dir", run, "trainer.total_steps=2", *args])
        rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
        # a checkpoint of step 1 (the sharded experts under FSDP2), resumed: step 2 repeats exactly
        rc_part = cli(["train", "--output-dir", part, "trainer.total_steps=1", *args])
        rc_resume = cli(["train", "--output-dir", part, "--resume", part, "trainer.total_steps=2", *args])
        again = [json.loads(line) for line in open(f"{part}/metrics.jsonl")]
        resumed = [k for k, v in rows[-1].items() if k not in MEASURED_KEYS and again[-1].get(k) != v]
    return {"rc": rc or rc_part or rc_resume, "kl": [r["rollout_corr/kl"] for r in rows],
            "agreement": [r["moe/route_agreement"] for r in rows], "steps_again": [r["step"] for r in again],
            "resume_differs": resumed}


def main() -> None:
    """`moe_device_checks.py DEVICE`: the parity stage and a run under the device's first strategy (FSDP2 on the
    simulated Ascend, DDP on emu); `moe_device_checks.py DEVICE STRATEGY`: the run alone, under that strategy."""
    device = sys.argv[1]
    backend = get_backend(device)
    calls = [0]
    errors = parity_errors(backend, calls) if len(sys.argv) == 2 else {}
    parallel = sys.argv[2] if len(sys.argv) > 2 else ("fsdp2" if device == "npu" else "ddp")
    print(json.dumps({"calls": calls[0], "experts": backend.spec.moe_experts, "errors": errors,
                      **train_and_resume(device, parallel)}))


if __name__ == "__main__":
    main()

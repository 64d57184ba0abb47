"""What one `rollout.mode=one_step_off` weight push costs the trainer's process in host memory traffic:
`python bench/push_copies.py [--hidden 512 --layers 8 --vocab 32000] [--precision fp32,bf16] [--device cpu]
[--json out.json]`.

Two pushes of the same Llama-shaped model (random weights, fp32 masters, on --device: the CPU, or an
accelerator whose tensors the push copies to the host) are counted:
- `queue (before)`: the push as rollout/process.py made it up to commit c468c23: each tensor cloned on the
  host, then put on a torch.multiprocessing queue, which moves every storage into shared memory
  (/dev/shm) once more; the sampler received fp32 whatever its precision;
- `staging (now)`: `SamplerProcess.update_weights`, into the inherited anonymous memory file, one copy
  per tensor, cast to the sampler's precision in that copy.

Counted: bytes written by host copy ops (clone, to, copy_) under a dispatch mode, and bytes moved into
shared memory by torch's storage sharing (the /dev/shm pages a push occupies), each also as a multiple
of the model's fp32 size. On an accelerator the old push made one more: the device-to-host `.to("cpu")`
before the clone.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostTraffic(TorchDispatchMode):
    """Bytes written to host memory by copy ops, and bytes moved into shared memory (while active)."""

    COPIES = {aten.clone.default, aten._to_copy.default, aten.copy_.default}

    def __init__(self) -> None:
        super().__init__()
        self.copied = self.shared = 0
        self._patched: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.copied += out.numel() * out.element_size()
        return out

    def __enter__(self):
        for name in ("_share_fd_cpu_", "_share_filename_cpu_"):
            original = getattr(torch.UntypedStorage, name)

            def counted(storage, *a, _original=original, **k):
                self.shared += storage.nbytes()
                return _original(storage, *a, **k)

            self._patched.append((name, original))
            setattr(torch.UntypedStorage, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.UntypedStorage, name, original)
        self._patched.clear()
        return super().__exit__(*exc)


def legacy_push(named) -> None:
    """The push of c468c23: clone each tensor, put the dict on a queue (flushed here, as its feeder thread
    would flush it while the trainer went on)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    state = {name: t.detach().to("cpu").clone() for name, t in named}
    queue.put(("weights", state))
    queue.close()
    queue.join_thread()


def model_of(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def measure(model, precision: str, model_dir: Path) -> dict:
    from types import SimpleNamespace

    from portagrpo.rollout.process import SamplerProcess, SamplerSpec

    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    rows = {}
    with HostTraffic() as before:
        legacy_push(model.named_parameters())
    rows["queue (before)"] = before
    tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0)  # what the sampler reads before a request
    spec = SamplerSpec(str(model_dir), "sdpa", tokenizer, precision, False, 1)
    sampler = SamplerProcess(spec, pad_id=0)
    try:
        with HostTraffic() as now:
            sampler.update_weights(model.named_parameters())
        sampler._until("loaded")  # the process took them (not counted: its own load into its copy)
    finally:
        sampler.close()
    rows["staging (now)"] = now
    return {name: {"host_copy_bytes": t.copied, "shared_memory_bytes": t.shared,
                   "host_copies_x_fp32_model": round(t.copied / fp32_bytes, 3),
                   "shared_memory_x_fp32_model": round(t.shared / fp32_bytes, 3)}
            for name, t in rows.items()} | {"fp32_model_bytes": fp32_bytes, "precision": precision}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--device", default="cpu", help="where the trainer's weights live (cpu, cuda, npu, emu)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from portagrpo.backends import get_backend

    torch.set_num_threads(1)
    model = model_of(args.hidden, args.layers, args.vocab)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        model.to(get_backend(args.device).device(0))
        for precision in args.precision.split(","):
            res = measure(model, precision, Path(tmp)) | {"device": args.device}
            results.append(res)
            print(f"model {res['fp32_model_bytes'] / 2**20:.1f} MiB in fp32 on {args.device}, sampler precision "
                  f"{precision}:")
            for name in ("queue (before)", "staging (now)"):
                r = res[name]
                print(f"  {name:15} host copies {r['host_copy_bytes'] / 2**20:8.1f} MiB "
                      f"({r['host_copies_x_fp32_model']}x fp32 model), into shared memory "
                      f"{r['shared_memory_bytes'] / 2**20:8.1f} MiB ({r['shared_memory_x_fp32_model']}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

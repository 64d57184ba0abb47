"""The sampler in a process of its own (`rollout.mode: one_step_off`).

The process holds its own copy of the policy (`SamplerCopy`: rollout.precision fp32, bf16 or int8) and
answers two messages, in the order they were sent: new weights (loaded, then requantized) and a
generation request (prompts, sampling settings and the request's seed, which the process seeds its
generator with, so a request's tokens depend only on the weights, the prompts and that seed). The
trainer sends the weights after each update and the next request right after taking a batch, so the
process samples batch k+1 while the trainer updates on batch k. Tensors travel through
torch.multiprocessing queues (shared memory); one thread per process unless trainer.num_threads says.
"""
from __future__ import annotations

import os
import queue
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from portagrpo.errors import UserError
from portagrpo.procs import sigint_ignored
from portagrpo.rollout.engines import Sampled, SamplingParams


@dataclass(frozen=True)
class SamplerSpec:
    """What the process builds its sampler from (pickled to it when it starts)."""

    model_path: str
    attn: str
    tokenizer: Any
    precision: str  # fp32 | bf16 | int8
    tied_embeddings: bool
    threads: int
    device: str = "cpu"  # "cpu", or an accelerator's "type:index"
    backend: str = "cpu"  # imported in the process first (a vendor's torch plugin registers its device)


def serve(spec: SamplerSpec, inbox, outbox, parent_pid: int) -> None:
    """The process's loop: ("weights", {name: tensor}) | ("generate", (ids, mask, params, seed)) | ("stop", None)."""
    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to report; it stops this process
    set_parent_death_signal()
    exit_with_parent(parent_pid, "sampler process")
    torch.set_num_threads(spec.threads)
    try:
        from portagrpo.backends import get_backend
        from portagrpo.model.loading import load_model

        if spec.device != "cpu":
            get_backend(spec.backend).set_device(torch.device(spec.device).index)
        from portagrpo.rollout.sampler_copy import SamplerCopy

        model = load_model(spec.model_path, spec.attn).to(spec.device)
        engine = SamplerCopy(model, spec.tokenizer, spec.precision, tied_embeddings=spec.tied_embeddings)
        outbox.put(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which stops with it
        outbox.put(("error", traceback.format_exc()))
        return
    while True:
        kind, payload = inbox.get()
        if kind == "stop":
            return
        try:
            if kind == "weights":
                engine.update_weights(payload.items())
            else:
                ids, mask, params, seed = payload
                torch.manual_seed(seed)
                sampled = engine.generate(ids.to(spec.device), mask.to(spec.device), params)
                outbox.put(("sampled", Sampled(*(None if t is None else t.cpu() for t in sampled))))
        except BaseException:  # noqa: BLE001
            outbox.put(("error", traceback.format_exc()))
            return


class SamplerProcess:
    """The trainer's handle on the sampler process: send weights, submit a request, take its result."""

    holds_weights = True
    POLL_S = 1.0

    def __init__(self, spec: SamplerSpec, pad_id: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or process groups
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.pad_id = pad_id
        self.process = ctx.Process(target=serve, args=(spec, self.inbox, self.outbox, os.getpid()), daemon=True,
                                   name="portagrpo-sampler")
        with sigint_ignored():
            self.process.start()
        self.waiting = False
        self._receive("ready")

    def _receive(self, expected: str):
        while True:
            try:
                kind, payload = self.outbox.get(timeout=self.POLL_S)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise UserError(f"the sampler process of rollout.mode=one_step_off exited (code "
                                    f"{self.process.exitcode}) without an answer; its error is printed above. "
                                    f"Use rollout.mode=sync to sample in the trainer's process.") from None
        if kind == "error":
            raise UserError(f"the sampler process of rollout.mode=one_step_off failed:\n{payload.rstrip()}")
        assert kind == expected, (kind, expected)
        return payload

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send the full weights (copied to shared memory); the process loads them before its next request."""
        state = {name: t.detach().to("cpu").clone() for name, t in named}
        self.inbox.put(("weights", state))
        return len(state)

    def submit(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, seed: int) -> None:
        if self.waiting:
            raise RuntimeError("one request at a time: take the pending result first")
        self.inbox.put(("generate", (prompt_ids.cpu(), prompt_mask.cpu(), params, int(seed))))
        self.waiting = True

    def result(self) -> Sampled:
        sampled = self._receive("sampled")
        self.waiting = False
        return sampled

    def close(self) -> None:
        if self.process.is_alive():
            self.inbox.put(("stop", None))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


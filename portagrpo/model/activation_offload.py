"""Activation offload (model.enable_activation_offload): what a training forward keeps for its backward moves to host
memory as it is saved, and comes back to the device when backward asks for it.

With gradient checkpointing each decoder layer keeps only its input (a reentrant checkpoint saves its inputs for
backward and recomputes the rest there), so the device holds one hidden state [N, hidden] per layer less: the layer
being recomputed is the only one whose activations are on the device. Without checkpointing every tensor the decoder
saves moves (more copies, the same saving per layer). Parameters are never copied: a saved weight stays where it is.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class HostActivations:
    """Saved-tensor hooks that park a forward's saved activations in host memory (page-locked where the backend row says
    `pinned_offload`, so the copies back can overlap compute)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.moved_bytes = 0  # what the last forward sent to the host (a measurement, read by tests)

    @contextlib.contextmanager
    def around(self, module: torch.nn.Module) -> Iterator[None]:
        """While a forward of `module` runs with autograd on: its saved activations go to host memory."""
        if not torch.is_grad_enabled():
            yield
            return
        weights = {id(p) for p in module.parameters()}
        self.moved_bytes = 0

        def pack(t: torch.Tensor):
            base = t if t._base is None else t._base
            if t.device.type == "cpu" or isinstance(base, torch.nn.Parameter) or id(base) in weights:
                return t  # already in host memory, or a weight (FSDP2's gathered ones included): kept as it is
            host = self._host_like(t)
            host.copy_(t, non_blocking=self.pinned)
            self.moved_bytes += t.numel() * t.element_size()
            return t.device, host

        def unpack(saved):
            if torch.is_tensor(saved):
                return saved
            device, host = saved
            return host.to(device, non_blocking=self.pinned)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
            except (NotImplementedError, RuntimeError):
                # a runtime without a page-locked allocator for its device (the simulated Ascend's PrivateUse1 one):
                # pageable memory, copied synchronously, from here on
                self.pinned = False
        return torch.empty(t.shape, dtype=t.dtype, layout=t.layout)


def checkpoint_kwargs(offload: bool, context_fn=None) -> dict | None:
    """transformers' gradient-checkpointing arguments: with activation offload the reentrant form, which saves each
    layer's inputs for backward (through the hooks above, so to host memory); the other form keeps them referenced on
    the device, where no hook sees them. `context_fn`: what a recomputation runs under (a MoE policy's routers replay
    the routes its forward did: model/router_replay.py `RouterHooks.checkpoint_context`), which only the non-reentrant
    form takes. None: transformers' default."""
    if offload:
        return {"use_reentrant": True}
    return None if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}

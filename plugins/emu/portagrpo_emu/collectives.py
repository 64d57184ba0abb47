"""A collective backend for emulated devices: a `torch.distributed.ProcessGroup` written in
Python (the pattern of PyTorch's own test/distributed/test_c10d_pypg.py) that takes device
tensors, runs each collective on their host payloads over a private gloo group, and writes the
results back into the same device tensors. DDP buckets, FSDP2's all-gather/reduce-scatter,
device meshes and DTensor redistribution all reach it through the dispatcher as they would
reach NCCL or HCCL.

Each group counts what it moved (collectives by kind, elements and bytes), so tests can hold a
training step to a budget. A vendor personality (the simulated HCCL) adds its refusals through
`refuse`, called with the op name and every device tensor before anything moves.

Host tensors follow torch's device rule for the group as it was formed: torch gives a process group only the
devices its backends name (torch/distributed/distributed_c10d.py, `Backend.backend_capability` and
`_new_process_group_helper`, torch 2.10 and 2.14 alike: NCCL serves `cuda` alone; torch_npu registers `hccl` with
`devices=["npu"]`, torch_npu/_init/registry/distributed.py v2.10.0.post4). A group formed with the library alone
refuses a CPU tensor with torch's own words, "No backend type associated with device type cpu"; one formed as
`cpu:gloo,<device>:<library>` hands it to gloo, where the library's refusals do not apply. A Python process group
stands for the whole group (torch breaks out of its per-device loop for one), so the group reads its own backend
string (`torch.distributed.get_backend_config`) to decide.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .counters import COUNTERS

Refusal = Callable[[str, list[torch.Tensor], Any], None]  # may also adjust the options (HCCL: bool SUM is MAX)


def _done(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class HostStagedGroup(dist.ProcessGroup):
    """Collectives on device tensors of one emulated device type, carried out on their CPU payloads."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, *, device_type: str,
                 backend_name: str, payload: Callable[[torch.Tensor], torch.Tensor],
                 refuse: Refusal | None = None) -> None:
        super().__init__(rank, size)
        self._serves_host: bool | None = None  # known once torch has recorded how the group was formed
        self._rank, self._size = rank, size
        self._device_type, self._name = device_type, backend_name
        self._payload, self._refuse = payload, refuse
        self._host = dist.ProcessGroupGloo(dist.PrefixStore(f"{backend_name}/host", store), rank, size, timeout)

    # -- identity: init_device_mesh and the functional collectives look groups up by name
    def getBackendName(self) -> str:  # noqa: N802 - the C++ name
        return self._name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    # torch names a group after creating it; a Python group keeps the name itself (the C++ getter reads
    # it from per-device backends, which a Python group does not have)
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    @property
    def host_tensors(self) -> bool:
        """Whether the group was formed with a CPU backend beside the library (`cpu:gloo,<device>:<library>`)."""
        if self._serves_host is None:
            try:
                config = dist.get_backend_config(self)
            except (ValueError, KeyError, RuntimeError, AttributeError, TypeError):
                return False  # not recorded yet (while torch forms the group): not cached
            pairs = [part.split(":", 1) for part in config.split(",") if ":" in part]
            self._serves_host = any(device.strip() == "cpu" for device, _ in pairs)
        return self._serves_host

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices the group serves; torch's object collectives pick their staging device from it
        (a CPU tensor for a group that takes host tensors, a device tensor for an HCCL-like one)."""
        return [torch.device("cpu"), torch.device(self._device_type)] if self.host_tensors \
            else [torch.device(self._device_type)]

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self.group_desc

    def __repr__(self) -> str:
        return f"HostStagedGroup({self._name}, rank {self._rank} of {self._size})"

    # -- staging
    def _host_view(self, op: str, tensors: list[torch.Tensor], opts: Any = None) -> list[torch.Tensor]:
        """The CPU tensors gloo runs on: each device tensor's payload (written in place, so the
        device tensor sees the result), or a host tensor itself where the library takes those."""
        bound = getattr(torch, self._device_type).current_device()
        for t in tensors:
            if t.device.type == self._device_type:
                if t.device.index != bound:
                    # NCCL and HCCL communicators belong to the one device a rank bound (set_device); a tensor on
                    # another device is another rank's device, which a real run meets as a hang or "Duplicate GPU"
                    raise RuntimeError(f"{op}: the {self._name} group of this rank runs on {self._device_type}:{bound} "
                                       f"(set_device), got a tensor on {t.device}")
                continue
            if t.device.type == "cpu" and self.host_tensors:
                continue
            # the words torch's ProcessGroup uses when no library of the group serves the device
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        on_device = [t for t in tensors if t.device.type == self._device_type]
        if self._refuse is not None and on_device:  # host tensors go to gloo, which the library's rules do not bind
            self._refuse(op, on_device, opts)
        return [self._payload(t) if t.device.type == self._device_type else t for t in tensors]

    def _run(self, op: str, counted: list[torch.Tensor], work: Any, result: Any) -> Any:
        work.wait()
        COUNTERS.collective(op, counted)
        return _done(result)

    # -- the collectives torch's data-parallel code calls
    def allreduce(self, tensors, opts):
        host = self._host_view("allreduce", tensors, opts)
        return self._run("all_reduce", tensors, self._host.allreduce(host, opts), tensors)

    def allreduce_coalesced(self, tensors, opts):
        host = self._host_view("allreduce_coalesced", tensors, opts)
        return self._run("all_reduce", tensors, self._host.allreduce_coalesced(host, opts), tensors)

    def broadcast(self, tensors, opts):
        host = self._host_view("broadcast", tensors, opts)
        return self._run("broadcast", tensors, self._host.broadcast(host, opts), tensors)

    def reduce(self, tensors, opts):
        """NCCL and HCCL both reduce to one root (torch's ProcessGroupNCCL::reduce, ncclReduce; torch_npu's
        ProcessGroupHCCL::reduce, HcclReduce, torch_npu/csrc/distributed/ProcessGroupHCCL.cpp): the streamed LM head
        (model/parallel.py RankRows) sums each rank's block of its gradient there. Only the root's tensor is
        defined afterwards."""
        host = self._host_view("reduce", tensors, opts)
        return self._run("reduce", tensors, self._host.reduce(host, opts), tensors)

    def allgather(self, output_lists, inputs, opts):
        host_in = self._host_view("allgather", inputs, opts)
        host_out = [self._host_view("allgather", outs, opts) for outs in output_lists]
        return self._run("all_gather", inputs, self._host.allgather(host_out, host_in, opts), output_lists)

    def gather(self, output_lists, inputs, opts):
        """torch.distributed.checkpoint's planning (gather_object / scatter_object_list) uses these two; NCCL and
        HCCL have them."""
        host_in = self._host_view("gather", inputs, opts)
        host_out = [self._host_view("gather", outs, opts) for outs in output_lists]
        return self._run("gather", inputs, self._host.gather(host_out, host_in, opts), output_lists)

    def scatter(self, outputs, input_lists, opts):
        host_out = self._host_view("scatter", outputs, opts)
        host_in = [self._host_view("scatter", ins, opts) for ins in input_lists]
        return self._run("scatter", outputs, self._host.scatter(host_out, host_in, opts), outputs)

    def _allgather_base(self, output, input, opts):
        host_out, host_in = self._host_view("all_gather_into_tensor", [output, input], opts)
        return self._run("all_gather", [input], self._host._allgather_base(host_out, host_in, opts), output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        for out, inp in zip(outputs, inputs):
            host_out, host_in = self._host_view("all_gather_into_tensor", [out, inp], opts)
            self._host._allgather_base(host_out, host_in).wait()
        COUNTERS.collective("all_gather", inputs)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts):
        # gloo has no list reduce-scatter: reduce each rank's chunk where it goes
        out_host = self._host_view("reduce_scatter", outputs, opts)
        for chunks in input_lists:
            stacked = torch.stack(self._host_view("reduce_scatter", chunks, opts))
            self._host.allreduce([stacked], _reduce_options(opts)).wait()
            out_host[0].copy_(stacked[self._rank])
        COUNTERS.collective("reduce_scatter", [c for chunks in input_lists for c in chunks])
        return _done(outputs)

    def _reduce_scatter_base(self, output, input, opts):
        host_out, host_in = self._host_view("reduce_scatter_tensor", [output, input], opts)
        summed = host_in.clone()
        self._host.allreduce([summed], _reduce_options(opts)).wait()
        host_out.copy_(summed.reshape(self._size, -1)[self._rank].reshape(host_out.shape))
        COUNTERS.collective("reduce_scatter", [input])
        return _done(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for out, inp in zip(outputs, inputs):
            self._reduce_scatter_base(out, inp, opts).wait()
        return _done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        host_out, host_in = self._host_view("all_to_all_single", [output, input], opts)
        work = self._host.alltoall_base(host_out, host_in, output_split_sizes, input_split_sizes, opts)
        return self._run("all_to_all", [input], work, output)

    # the names torch.distributed's Python front end calls (2.8 and later) for the same collectives
    def all_gather_single(self, output, input, opts):
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts):
        return self._reduce_scatter_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        self._host.barrier().wait()
        return _done(None)


def _reduce_options(opts: Any) -> dist.AllreduceOptions:
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp
    return out


def register(backend_name: str, device_type: str, payload: Callable[[torch.Tensor], torch.Tensor],
             refuse: Refusal | None = None) -> None:
    """Make `init_process_group(backend_name)` (or `cpu:gloo,<device_type>:<backend_name>`) form a HostStagedGroup,
    registered for its device alone, as NCCL and HCCL are. Idempotent."""
    if backend_name in dist.Backend.backend_list:
        return

    def create(store, rank, size, timeout):
        return HostStagedGroup(store, rank, size, timeout, device_type=device_type, backend_name=backend_name,
                               payload=payload, refuse=refuse)

    dist.Backend.register_backend(backend_name, create, devices=[device_type])

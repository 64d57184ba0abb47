"""The collective libraries of the emulated devices, checked in one process (a group of one rank
runs every collective's full path: staging, refusals, counting). Run under the simulated Ascend's
environment for `hccl` checks (argument "hccl"), else `emuccl`. Exits 0 and prints ok."""
import sys

import torch
import torch.distributed as dist

from portagrpo.backends import get_backend


def group_on(device: str, form: str = "library") -> tuple[torch.device, torch.Tensor]:
    """A one-rank group over `device`'s collective library (`form`: the library alone, or "run" as portagrpo forms
    a run's group, with gloo for the host); its device and a tensor all-reduced there."""
    backend = get_backend(device)
    dev = backend.device(0)
    name = backend.dist_backend if form == "library" else backend.group_backend
    dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
    t = torch.arange(4.0, device=dev)
    dist.all_reduce(t)
    assert t.device == dev and t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    return dev, t


def emuccl():
    group_on("emu")
    try:  # the library alone serves its device alone, as torch's rule is for NCCL and HCCL
        dist.all_reduce(torch.ones(3))
    except RuntimeError as err:
        assert "No backend type associated with device type cpu" in str(err), str(err)
    else:
        raise AssertionError("a group formed with emuccl alone took a host tensor")
    dist.destroy_process_group()
    dev, t = group_on("emu", form="run")
    assert "cpu:gloo" in dist.get_backend_config(), dist.get_backend_config()
    from portagrpo_emu.counters import COUNTERS

    host = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(host)  # formed as "cpu:gloo,emu:emuccl": host tensors go to gloo as they are
    out = torch.empty(4, device=dev)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t)
    box = [{"a": 1}]
    dist.broadcast_object_list(box, 0)
    root = torch.full((2,), 3.0, device=dev)
    dist.reduce(root, 0)  # the streamed LM head's (model/parallel.py RankRows): the sum on the root's device tensor
    assert root.device == dev and root.cpu().tolist() == [3.0, 3.0]
    calls = COUNTERS.total("collectives")
    # all-reduces: the library-alone group's device one, then the run's group's device and host ones
    assert calls["all_reduce"] == 3 and calls["all_gather"] == 1 and calls["reduce_scatter"] == 1, calls
    assert calls["reduce"] == 1, calls


def hccl():
    import torch_npu  # noqa: F401 - the stand-in (plugins/npu_sim), as a real run imports the real one

    dev, t = group_on("npu")  # HCCL alone: host tensors refused (below)
    refused = {
        "float64 all_reduce": (lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64, device=dev)),
                               "HCCL allreduce: Unsupported data type at::kDouble"),
        "float64 reduce_scatter": (lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64, device=dev),
                                                                      torch.ones(2, dtype=torch.float64, device=dev)),
                                   "HCCL _reduce_scatter_base: Unsupported data type at::kDouble"),
        "float64 reduce": (lambda: dist.reduce(torch.ones(2, dtype=torch.float64, device=dev), 0),
                           "HCCL reduce: Unsupported data type at::kDouble"),
        "host tensor": (lambda: dist.all_reduce(torch.ones(2)), "No backend type associated with device type cpu"),
        # (complex never reaches a library: torch.distributed passes it as a real view)
        "float8_e4m3fnuz": (lambda: dist.broadcast(torch.zeros(2, device=dev).to(torch.float8_e4m3fnuz), 0),
                            "Unsupported data type for HCCL process group"),
        "BAND": (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32, device=dev), op=dist.ReduceOp.BAND),
                 "Cannot use ReduceOp.BAND with HCCL"),
        "non-contiguous": (lambda: dist.all_reduce(torch.ones(2, 3, device=dev).t()), "Tensors must be contiguous"),
    }
    for what, (call, words) in refused.items():
        try:
            call()
        except RuntimeError as err:
            assert words in str(err), (what, str(err))
        else:
            raise AssertionError(f"the simulated HCCL accepted a {what}")
    # All-gather and broadcast move float64 (HCCL: "AllGather & Broadcast support all data type")
    d = torch.full((2,), 0.1, dtype=torch.float64, device=dev)
    out = torch.empty(2, dtype=torch.float64, device=dev)
    dist.all_gather_into_tensor(out, d)
    assert out.cpu().tolist() == [0.1, 0.1]
    # portagrpo's own exact float64 sum goes through int64 bit patterns, which HCCL accepts
    from portagrpo.backends.dist import DistEnv, ProcessGroupCollectives

    comm = ProcessGroupCollectives(DistEnv(), get_backend("npu"), 60)
    assert comm.sum_on_host(torch.tensor([0.1, 0.2], dtype=torch.float64)).tolist() == [0.1, 0.2]
    box = [{"a": 1}]
    dist.broadcast_object_list(box, 0)  # staged on the NPU, as with a real HCCL group
    assert box == [{"a": 1}]
    dist.destroy_process_group()
    dev, t = group_on("npu", form="run")  # as a run forms it: "cpu:gloo,npu:hccl"
    host = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(host)  # gloo's, which reduces float64; HCCL's refusals bind its device tensors only
    assert host.tolist() == [1.0, 1.0]
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.float64, device=dev))
    except RuntimeError as err:
        assert "HCCL allreduce: Unsupported data type at::kDouble" in str(err), str(err)
    else:
        raise AssertionError("the simulated HCCL reduced a float64 NPU tensor in a cpu:gloo,npu:hccl group")


if __name__ == "__main__":
    (hccl if sys.argv[1:] == ["hccl"] else emuccl)()
    dist.destroy_process_group()
    print("ok")

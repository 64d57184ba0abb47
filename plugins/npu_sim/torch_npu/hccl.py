"""What the simulated `hccl` backend refuses, as torch_npu's ProcessGroupHCCL refuses it
(Ascend/pytorch master 9e73e708; the v2.1 and v2.6 release branches agree except where noted):

- tensors that are not on the NPU: the group is registered with devices=["npu"] only
  (torch_npu/_init/registry/distributed.py), so torch's ProcessGroup answers
  "No backend type associated with device type cpu" (raised in portagrpo_emu.collectives);
- non-contiguous tensors: "Tensors must be contiguous" (ProcessGroupHCCL.cpp);
- dtypes outside `kScalarTypeToHcclDataType` (HCCLUtils.cpp): "Unsupported data type for HCCL
  process group";
- reductions (allreduce, reduce, reduce_scatter and their variants) on dtypes outside
  INT8/INT16/INT32/INT64/FP16/FP32/BF16 (`checkSupportedDataType`, ProcessGroupHCCL.cpp; FP64
  and UINT64 only on Ascend950 and later, which this simulation is not):
  "HCCL allreduce: Unsupported data type at::kDouble". Bool and uint8 all-reduces are first cast
  to int32 there, and a SUM over bool becomes MAX;
- ReduceOp.BAND/BOR/BXOR: "Cannot use ReduceOp.BAND with HCCL" (`getHcclReduceOp`).

All-gather and broadcast move every mapped dtype, float64 included ("AllGather & Broadcast
support all data type").
"""
from __future__ import annotations

import torch
import torch.distributed as dist

MAPPED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.bool, torch.bfloat16, torch.uint16, torch.uint32, torch.uint64}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        MAPPED.add(getattr(torch, _name))
REDUCIBLE = {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
CAST_TO_INT_FOR_ALLREDUCE = {torch.bool, torch.uint8}
# the function names HCCL's messages carry (__FUNCTION__ in ProcessGroupHCCL.cpp)
REDUCTIONS = {"allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "reduce": "reduce",
              "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "_reduce_scatter_base"}
_ATEN_NAMES = {torch.float64: "Double", torch.uint64: "UInt64", torch.bool: "Bool", torch.uint8: "Byte",
               torch.uint16: "UInt16", torch.uint32: "UInt32", torch.complex64: "ComplexFloat",
               torch.complex128: "ComplexDouble"}


def refuse(op: str, tensors: list[torch.Tensor], opts) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise RuntimeError("Tensors must be contiguous")
        if t.dtype not in MAPPED:
            raise RuntimeError("Unsupported data type for HCCL process group")
    if op not in REDUCTIONS:
        return
    reduce_op = getattr(opts, "reduceOp", None)
    for name in ("BAND", "BOR", "BXOR"):
        if reduce_op == getattr(dist.ReduceOp, name):
            raise RuntimeError(f"Cannot use ReduceOp.{name} with HCCL")
    for t in tensors:
        if op.startswith("allreduce") and t.dtype in CAST_TO_INT_FOR_ALLREDUCE:
            continue
        if t.dtype not in REDUCIBLE:
            raise RuntimeError(f"HCCL {REDUCTIONS[op]}: Unsupported data type at::k{_ATEN_NAMES.get(t.dtype, t.dtype)}")
    if op.startswith("allreduce") and reduce_op == dist.ReduceOp.SUM and any(t.dtype == torch.bool for t in tensors):
        opts.reduceOp = dist.ReduceOp.MAX  # HCCL sums booleans as a logical or

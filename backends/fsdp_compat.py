"""FSDP2 gradient sums on every torch portagrpo supports, kept apart because the torch < 2.8 path
sets a private attribute.

portagrpo's losses already divide by the global token or sequence count, so FSDP2 must *sum*
gradients across ranks, never average them. torch >= 2.8 says so publicly
(`set_gradient_divide_factor(1.0)` + `set_force_sum_reduction_for_comms(True)`). torch 2.6 and 2.7
have only `set_reduce_scatter_divide_factor`, which becomes NCCL's PREMUL_SUM: refused by Ascend's
collectives (the NPU build for 2.7.1), by NCCL for bf16, and ignored by gloo. Their param group reads the op from
`FSDPParamGroup.reduce_scatter_reduce_op` (None = AVG), so a plain ReduceOp.SUM there is a sum on
every collective library for fp32/bf16 gradients (read in torch 2.7.1's _fsdp_param_group.py and
_fsdp_collectives.py `foreach_reduce`). For fp16/fp64 gradients torch 2.7 also pre- and post-divides
by the world size, so that combination is refused (FSDP2 reduces in fp32 under bf16/fp16 compute).
`PRIVATE_FALLBACK_TORCH` names the versions this was read and tested on; tests/unit/test_fsdp_compat.py
fails loudly if a torch in that range changes the attribute.
"""
from __future__ import annotations

import torch

PRIVATE_FALLBACK_TORCH = ((2, 6), (2, 7))  # (major, minor) where the private attribute is used


def torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def native_sum() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def fsdp2_problem(reduce_dtype: torch.dtype | None = None) -> str | None:
    """Why FSDP2 cannot sum gradients on this torch (one sentence), or None."""
    if native_sum():
        return None
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - public from torch 2.6
    except ImportError:
        return (f"trainer.parallel=fsdp2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); torch "
                f"{torch.__version__} is installed: upgrade torch or use trainer.parallel=ddp.")
    if torch_minor() not in PRIVATE_FALLBACK_TORCH:
        return (f"trainer.parallel=fsdp2 on torch {torch.__version__} has no tested way to sum gradients across "
                f"ranks; use torch 2.6-2.7 or >= 2.8, or trainer.parallel=ddp.")
    if reduce_dtype in (torch.float16, torch.float64):
        return (f"trainer.parallel=fsdp2 with {reduce_dtype} gradients averages them on torch {torch.__version__} "
                f"(it divides by the world size around the reduction); use model.dtype=fp32 or bf16, torch >= 2.8, "
                f"or trainer.parallel=ddp.")
    return None


def sum_gradients(module) -> None:
    """Make this FSDP2 unit reduce-scatter its gradients as a plain sum."""
    if native_sum():
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo and HCCL have no PREMUL_SUM
        return
    import torch.distributed as dist

    group = module._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 - torch 2.6/2.7 only, see above
    if group is None:  # a unit that owns no parameters reduces nothing
        return
    if not hasattr(group, "reduce_scatter_reduce_op"):
        raise RuntimeError(f"torch {torch.__version__} changed FSDPParamGroup (no reduce_scatter_reduce_op); "
                           f"portagrpo cannot sum FSDP2 gradients on it: use trainer.parallel=ddp.")
    group.reduce_scatter_reduce_op = dist.ReduceOp.SUM


def keep_gathered(unit, keep: bool) -> bool:
    """Keep a unit's parameters gathered after forward (torch >= 2.8); False where torch cannot, and
    generation then gathers per forward as usual (slower, same result)."""
    setter = getattr(unit, "set_reshard_after_forward", None)
    if setter is None:
        return False
    setter(not keep, recurse=False)
    return True

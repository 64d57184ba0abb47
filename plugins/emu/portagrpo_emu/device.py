"""An emulated accelerator: a torch device named `emu` that is not the CPU, but computes on it.

It is built the way an out-of-tree vendor (Ascend's torch_npu, for one) plugs into PyTorch:
the PrivateUse1 dispatch key is renamed, a device module is registered as `torch.emu`, and
kernels come from Python. Every `emu` tensor is a wrapper whose payload is a CPU tensor, so
arithmetic is real (the same CPU kernels, the same numbers), while the device rules that a GPU
or NPU enforces are enforced here too:

- tensors on different devices (a CPU index for a device tensor, `emu:0` meeting `emu:1`) raise
  "Expected all tensors to be on the same device", except CPU 0-dim tensors (scalars) and the
  CPU indices of advanced indexing, which CUDA also accepts;
- random ops draw from the device's own generator (seeded by `torch.manual_seed`, saved and
  restored by `torch.emu.get_rng_state_all`), never from the CPU generator, and a CPU
  `torch.Generator` handed to a device op is refused, as CUDA refuses it;
- `.numpy()` needs `.cpu()` first; memory is counted per device (allocated, peak, free);
- autocast works through torch's AutocastPrivateUse1 key with bf16/fp16.

`install()` must run before any `emu` tensor exists; it is idempotent and is called by the
backend when `--device emu` is chosen. The simulated Ascend (plugins/npu_sim) installs the same
device under the name `npu`.

Devices per process: `PORTAGRPO_EMU_DEVICES=N` (default 1) gives the process N devices, `emu:0` to
`emu:N-1`, each with its own generator and memory counters, as a process on a node sees the node's
accelerators; `PORTAGRPO_EMU_VISIBLE_DEVICES` narrows them as CUDA_VISIBLE_DEVICES does, read once when
the device is installed, as torch reads CUDA_VISIBLE_DEVICES once when CUDA initialises
(portagrpo_emu/multi_device.py, which also builds the C++ device guard that lets autograd run on every
index). `get_device_name` names the machine's device, so two processes can tell whether they hold the
same one. Several ranks are several processes, whose collectives go through portagrpo_emu.collectives.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .counters import COUNTERS

NAME = "emu"
_INSTALLED = False
aten = torch.ops.aten

# Ops that legitimately move data between devices.
_TRANSFER_OPS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
                 aten._copy_from_and_resize.default}
# Advanced indexing accepts CPU index tensors on CUDA (they are moved to the device).
_CPU_INDEX_OK = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                 aten._index_put_impl_.default}


def device_count() -> int:
    """The `emu` devices this process sees (portagrpo_emu/multi_device.py: PORTAGRPO_EMU_DEVICES)."""
    from .multi_device import emu_device_count

    return emu_device_count()


class _State:
    """Per-process device state: current device, one generator and memory counters per device, and which of the
    machine's devices each one is (the visible-devices list as it was when the device was installed)."""

    def __init__(self, n: int, machine_ids: list[int] | None = None) -> None:
        self.machine_ids = list(machine_ids) if machine_ids is not None else list(range(n))
        self.current = 0
        self.generators = [torch.Generator().manual_seed(67280421310721 + i) for i in range(n)]
        self.allocated = [0] * n
        self.peak = [0] * n
        self.storages: dict[int, int] = {}  # storage key -> device index
        self.streams: dict[int, Any] = {}

    def default_stream(self, idx: int) -> "Stream":
        if idx not in self.streams:
            self.streams[idx] = Stream(idx)
        return self.streams[idx]

    def index(self, device: torch.device | str | int | None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            idx = device
        else:
            device = torch.device(device)
            idx = self.current if device.index is None else device.index
        if not 0 <= idx < len(self.generators):
            raise RuntimeError(f"{NAME} device {idx} is out of range: {len(self.generators)} device(s) visible.")
        return idx

    def track(self, inner: torch.Tensor, idx: int) -> None:
        """Count a new storage against device `idx` until the last tensor using it is freed."""
        storage = inner.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.storages:
            return
        nbytes = storage.nbytes()
        self.storages[key] = idx
        self.allocated[idx] += nbytes
        self.peak[idx] = max(self.peak[idx], self.allocated[idx])

        def release(key=key, idx=idx, nbytes=nbytes) -> None:
            if self.storages.pop(key, None) is not None:
                self.allocated[idx] -= nbytes

        weakref.finalize(storage, release)


    def resize(self, inner: torch.Tensor, idx: int, nbytes: int) -> None:
        """Resize the storage under `inner` (FSDP2 frees and re-allocates unsharded parameters this way)."""
        storage = inner.untyped_storage()
        old = self.storages.pop(storage.data_ptr(), None)
        if old is not None:
            self.allocated[old] -= storage.nbytes()
        storage.resize_(nbytes)
        if nbytes:
            key = storage.data_ptr()
            self.storages[key] = idx
            self.allocated[idx] += nbytes
            self.peak[idx] = max(self.peak[idx], self.allocated[idx])


STATE: _State | None = None


def payload_storage_size(tensor: torch.Tensor) -> int:
    """Bytes held by a device tensor's payload storage."""
    return tensor._inner.untyped_storage().nbytes()


def resize_payload_storage(tensor: torch.Tensor, nbytes: int) -> None:
    STATE.resize(tensor._inner, tensor.device.index, nbytes)


class EmuTensor(torch.Tensor):
    """A tensor on an `emu` device; `_inner` is the CPU tensor holding its values."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device(NAME, index), requires_grad=False)
        out._inner = inner
        return out

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return f"{self._inner!r}".replace("tensor(", "emu_tensor(", 1)[:-1] + f", device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if any(not issubclass(t, EmuTensor) for t in types):
            # Another tensor subclass among the arguments (torch's AsyncCollectiveTensor, which the functional
            # collectives return, saved for a backward): it unwraps itself to device tensors and dispatches again,
            # as it does around a CUDA tensor, where no second subclass stands in its way.
            return NotImplemented
        return _dispatch(func, args, kwargs or {})

    def __format__(self, spec: str) -> str:
        return self.item().__format__(spec) if self.dim() == 0 else object.__format__(self, spec)

    def tolist(self):  # a device-to-host copy, as on CUDA
        COUNTERS.sync("tolist")
        return self._inner.tolist()

    def numpy(self, *args, **kwargs):  # noqa: D102
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        f"tensor to host memory first.")


def _wrap(inner: torch.Tensor, idx: int) -> EmuTensor:
    STATE.track(inner, idx)
    return EmuTensor(inner, idx)


def _mismatch(func, a: torch.device, b: torch.device) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
                        f"(when checking arguments for {func})")


def _common_index(func, args, kwargs) -> int:
    """The device index the op runs on, after checking every tensor argument as a GPU would."""
    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    index = None
    for t in flat:
        if isinstance(t, EmuTensor):
            if index is None:
                index = t.device.index
            elif t.device.index != index:
                raise _mismatch(func, torch.device(NAME, index), t.device)
    if func in _TRANSFER_OPS:
        return index
    for t in flat:
        if isinstance(t, torch.Tensor) and not isinstance(t, EmuTensor):
            if t.dim() == 0 and t.device.type == "cpu":
                continue  # a CPU scalar tensor is read as a number
            if func in _CPU_INDEX_OK and _is_index_arg(func, args, t):
                continue
            raise _mismatch(func, torch.device(NAME, index), t.device)
    return index


def _is_index_arg(func, args, t: torch.Tensor) -> bool:
    indices = args[1] if len(args) > 1 else []
    return isinstance(indices, (list, tuple)) and any(i is t for i in indices)


def _generator_for(func, kwargs: dict, idx: int) -> None:
    """Random ops draw from the device's generator; a CPU generator is refused, as on CUDA."""
    if not any(a.name == "generator" for a in func._schema.arguments):
        return
    gen = kwargs.get("generator")
    if gen is None:
        kwargs["generator"] = STATE.generators[idx]
    elif not any(gen is g for g in STATE.generators):
        raise RuntimeError(f"Expected a '{NAME}' device type for generator but found '{gen.device.type}'")


def _unwrap(x):
    return x._inner if isinstance(x, EmuTensor) else x


_PYTHON_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _dispatch(func, args, kwargs):
    if func.namespace in _COLLECTIVE_NAMESPACES:
        # Collectives take the device tensors themselves: torch's own kernel hands them to the process
        # group registered for the device (portagrpo_emu.collectives), which stages them through the host.
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEY):
            return func(*args, **kwargs)
    if func is aten.record_stream.default:
        return None  # every kernel is finished when it returns: no allocator bookkeeping to do
    idx = _common_index(func, args, kwargs)
    _count(func, args)
    if func is aten._to_copy.default:
        return _to_copy(args[0], kwargs)
    if func is aten.copy_.default and not isinstance(args[0], EmuTensor):  # host_tensor.copy_(device_tensor)
        COUNTERS.sync("copy to host")
        return args[0].copy_(_unwrap(args[1]), *args[2:])
    if func is _MM_DTYPE:
        return _mixed_mm(args, kwargs, idx)
    if func is aten.native_dropout.default:
        return _dropout(args, idx)
    target = kwargs.get("device")
    if target is not None and torch.device(target).type == NAME:  # new_zeros(..., device="emu:1")
        idx = STATE.index(target)
        kwargs = dict(kwargs, device=torch.device("cpu"))
    _generator_for(func, kwargs, idx)
    inner_args, inner_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
    out = func(*inner_args, **inner_kwargs)
    return _rewrap(out, args, inner_args, idx)


# Ops whose result the host must wait for: a value read back, or an output shape that depends on the data.
_SYNC_OPS = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
             aten.masked_select.default: "masked_select", aten.equal.default: "equal",
             aten._unique2.default: "unique", aten.unique_consecutive.default: "unique"}
_MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm",
            aten.baddbmm.default: "baddbmm"}
# torch.mm(a, b, out_dtype=torch.float32) on bf16/fp16 operands: what a GPU's tensor cores do (CUDA has
# it; the CPU does not), so kernels that ask for it (portagrpo.kernels.matmul) take the same path here.
_MM_DTYPE = getattr(aten.mm, "dtype", None)
if _MM_DTYPE is not None:
    _MATMULS[_MM_DTYPE] = "mm"


def _mixed_mm(args, kwargs, idx):
    a, b = args[0], args[1]
    out_dtype = args[2] if len(args) > 2 else kwargs["out_dtype"]
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16) or out_dtype != torch.float32:
        raise RuntimeError(f"mm with out_dtype: operands must share bf16 or fp16 and the result be fp32 "
                           f"(got {a.dtype}, {b.dtype} -> {out_dtype})")
    return _wrap(a._inner.float() @ b._inner.float(), idx)


def _count(func, args) -> None:
    """Host synchronisations by cause and matrix products by operand dtype (portagrpo_emu.counters)."""
    cause = _SYNC_OPS.get(func)
    if cause is not None:
        COUNTERS.sync(cause)
    elif func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in (args[1] if len(args) > 1 else []) or []):
        COUNTERS.sync("boolean-mask index")
    elif func in _MATMULS:
        operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
        COUNTERS.matmul(_MATMULS[func], [a.dtype for a in operands], out_features=operands[-1].shape[-1])


def _rewrap(out, args, inner_args, idx):
    """Wrap fresh CPU results as device tensors; results aliasing an input (in-place ops,
    `out=`) come back as that input's wrapper, so its identity and autograd state survive."""
    originals = {id(i): a for a, i in zip(torch.utils._pytree.tree_leaves(args),
                                          torch.utils._pytree.tree_leaves(inner_args)) if isinstance(a, EmuTensor)}

    def wrap(x):
        if not isinstance(x, torch.Tensor) or isinstance(x, EmuTensor):
            return x
        if id(x) in originals:
            return originals[id(x)]
        return _wrap(x, idx)

    return tree_map(wrap, out)


def _to_copy(src, kwargs):
    kwargs = dict(kwargs)
    target = kwargs.pop("device", None)
    inner = _unwrap(src)
    if target is not None and torch.device(target).type == "cpu":
        COUNTERS.sync("copy to host")
        return aten._to_copy.default(inner, **kwargs)  # a host copy: a plain CPU tensor
    idx = STATE.index(target) if target is not None else src.device.index
    return _wrap(aten._to_copy.default(inner, **kwargs), idx)


def _scalar_below_python(tensor):
    """`.item()` reached with the Python key excluded: torch.tensor([device scalars]) reads its items so (the
    generic fallback cannot take this op there). A host read, as on a GPU."""
    COUNTERS.sync("item")
    return tensor._inner.item()


def _dropout(args, idx):
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else True
    inner = x._inner
    if not train or p == 0:
        return _wrap(inner.clone(), idx), _wrap(torch.ones_like(inner, dtype=torch.bool), idx)
    keep = torch.empty_like(inner, dtype=torch.bool).bernoulli_(1 - p, generator=STATE.generators[idx])
    return _wrap(inner * keep / (1 - p), idx), _wrap(keep, idx)


def _factory_fallback(op, *args, **kwargs):
    """Ops that reach the PrivateUse1 key without an `emu` tensor argument: factories
    (`torch.empty(..., device="emu")`, `arange`, `randperm`, ...). Run on the CPU, then wrap."""
    idx = STATE.index(kwargs.get("device"))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    _generator_for(op, kwargs, idx)
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    out = op(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    return tree_map(lambda x: _wrap(x, idx) if isinstance(x, torch.Tensor) and not isinstance(x, EmuTensor) else x, out)


# Autocast, as torch's CUDA autocast does it (aten/src/ATen/autocast_mode.cpp): ops that run in
# the low-precision dtype, ops forced to float32, ops that promote to their widest input.
_LOWER = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "addmm",
          "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
          "chain_matmul", "linalg_multi_dot", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention"}
_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "norm", "frobenius_norm",
         "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "softmax", "log_softmax", "cumprod", "cumsum", "sum", "prod"}
_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
            "tensordot", "cat", "stack"}
_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _autocast_kernel(op, policy: str):
    def kernel(*args, **kwargs):
        if policy == "lower":
            dtype = torch.get_autocast_dtype(NAME)
        elif policy == "fp32":
            dtype = torch.float32
        else:
            floats = [t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()]
            dtype = max(floats, key=lambda d: torch.finfo(d).bits) if floats else None

        def cast(x):
            if (dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.dtype != torch.float64 and x.device.type == NAME):
                return x.to(dtype)
            return x

        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def _register_autocast(lib) -> None:
    """Ops of the three lists get a casting kernel at AutocastPrivateUse1; every other op falls through."""
    lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    aten_lib = torch.library.Library("aten", "IMPL")
    for names, policy in ((_LOWER, "lower"), (_FP32, "fp32"), (_PROMOTE, "promote")):
        for name in sorted(names):
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                    continue  # out= and in-place variants are not autocast
                qual = name if overload == "default" else f"{name}.{overload}"
                aten_lib.impl(qual, _autocast_kernel(op, policy), "AutocastPrivateUse1")
    _KEEP.append(aten_lib)


class Event:
    """A device event. Every emulated kernel has finished when its call returns, so an event is
    complete as soon as it is recorded; `synchronize` is counted as a host synchronisation."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: "Stream | None" = None) -> None:
        self.recorded = True

    def wait(self, stream: "Stream | None" = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        COUNTERS.sync("Event.synchronize")

    def elapsed_time(self, end: "Event") -> float:
        return 0.0


class Stream:
    """A device stream: work on it is already done (see Event); ordering between streams is not modelled."""

    def __init__(self, device=None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device(NAME, STATE.index(device))
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        COUNTERS.sync("Stream.synchronize")


class _StreamContext:
    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream

    def __enter__(self) -> Stream | None:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


class EmuModule:
    """`torch.emu`: what torch and portagrpo's backend ask a device module."""

    Stream = Stream
    Event = Event

    @staticmethod
    def current_stream(device=None) -> Stream:
        return STATE.default_stream(STATE.index(device))

    @staticmethod
    def default_stream(device=None) -> Stream:
        return STATE.default_stream(STATE.index(device))

    @staticmethod
    def stream(stream: Stream | None) -> _StreamContext:
        return _StreamContext(stream)

    @staticmethod
    def set_stream(stream: Stream) -> None:
        return None

    @staticmethod
    def is_available() -> bool:
        return len(STATE.generators) > 0

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return len(STATE.generators)

    @staticmethod
    def current_device() -> int:
        return STATE.current

    @staticmethod
    def set_device(device) -> None:
        from .multi_device import set_current

        STATE.current = STATE.index(device)
        set_current(STATE.current)

    @staticmethod
    def get_device_name(device=None) -> str:
        """Names the machine's device, as a GPU's name and UUID tell two GPUs apart whatever a process calls them."""
        return f"emulated accelerator {STATE.machine_ids[STATE.index(device)]} (CPU arithmetic)"

    @staticmethod
    def is_bf16_supported() -> bool:
        return True

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def manual_seed(seed: int) -> None:
        STATE.generators[STATE.current].manual_seed(int(seed))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        for g in STATE.generators:
            g.manual_seed(int(seed))

    @staticmethod
    def get_rng_state_all() -> list[torch.Tensor]:
        return [g.get_state() for g in STATE.generators]

    @staticmethod
    def set_rng_state_all(states) -> None:
        for g, s in zip(STATE.generators, states):
            g.set_state(s)

    @staticmethod
    def synchronize(device=None) -> None:
        COUNTERS.sync("synchronize")

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(device=None) -> int:
        return STATE.allocated[STATE.index(device)]

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return STATE.peak[STATE.index(device)]

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        idx = STATE.index(device)
        STATE.peak[idx] = STATE.allocated[idx]

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        total = 16 * 2**30
        return total - STATE.allocated[STATE.index(device)], total


def _copy_kernel(dst, src, non_blocking=False):
    """`copy_` reached below the Python key (torch.tensor(data, device=...) excludes it)."""
    _unwrap(dst).copy_(_unwrap(src))
    return dst


def install(name: str = "emu", module: Any = None, count: int | None = None) -> None:
    """Make `name` (`emu`, or `npu` for the simulated Ascend) a torch device in this process (once),
    with `module` (an EmuModule by default) as `torch.<name>` and `count` devices (by default what
    PORTAGRPO_EMU_DEVICES says)."""
    global _INSTALLED, STATE, NAME
    if _INSTALLED:
        if name != NAME:
            raise RuntimeError(f"the emulated device is already installed as {NAME!r} in this process; "
                               f"it cannot also be {name!r}.")
        return
    NAME = name
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"the PrivateUse1 device is already taken by {current!r} in this process; "
                           f"the emulated device cannot be installed beside it.")
    from .multi_device import emu_device_ids

    # the visible-devices variable is read here, once: the process's devices are fixed from its first use on
    machine_ids = emu_device_ids() if count is None else None
    count = len(machine_ids) if count is None else count
    if count > 1:  # before torch registers its Python device guard, which reports one device
        from .multi_device import load_guard

        load_guard(count)
    STATE = _State(count, machine_ids)
    # A C++ backend's tensors take `param.data = moved` in Module.to(), which keeps tied weights (embedding and
    # LM head) one Parameter. A Python wrapper cannot, so swap tensors in place to keep the same identity.
    torch.__future__.set_swap_module_params_on_conversion(True)
    _setup_privateuseone_for_python_backend(NAME, backend_module=module or EmuModule())
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(_factory_fallback, dispatch_key="PrivateUse1")
    _register_autocast(lib)
    aten_lib = torch.library.Library("aten", "IMPL")
    aten_lib.impl("copy_", _copy_kernel, "PrivateUse1")
    # arange's generic kernel fills an empty(0) through arange.out, which resizes the CPU payload but not the
    # wrapper's shape (torch.arange(4, device=...) read as size [0]): run it on the CPU and wrap, as factories.
    for qual, op in (("arange", aten.arange.default), ("arange.start", aten.arange.start),
                     ("arange.start_step", aten.arange.start_step)):
        aten_lib.impl(qual, functools.partial(_factory_fallback, op), "PrivateUse1")
    aten_lib.impl("_local_scalar_dense", _scalar_below_python, "PrivateUse1")
    _KEEP.append(aten_lib)
    _KEEP.append(lib)
    _INSTALLED = True
    global FSDP2_PROBLEM
    from . import fsdp_storage

    try:
        fsdp_storage.install(lambda t: isinstance(t, EmuTensor))
    except fsdp_storage.UnsupportedTorch as err:
        FSDP2_PROBLEM = str(err)


# Why FSDP2 cannot run on this device with this torch (set by install), or None.
FSDP2_PROBLEM: str | None = None


_KEEP: list[Any] = []

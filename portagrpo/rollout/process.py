"""The sampler in a process of its own (`rollout.mode: one_step_off`).

The process holds its own copy of the policy: with rollout.engine=hf a `SamplerCopy` (rollout.precision fp32,
bf16 or int8), with rollout.engine=vllm a vLLM engine (`VLLMRollout`, in model.dtype) built from the run's initial
model, and the run's generator (rollout/generators/: text, vision or conversation rows; a conversation's tool sandbox
starts here, where its turns are sampled). It answers two messages, in the order they were sent: new weights (loaded,
then requantized or prepared for vLLM's kernels) and a round to generate (this rank's prompts as the trainer's
pipeline prepared them, sampling settings, the prompt width and the request's seed, which the process seeds its
random streams with, so a round's rows depend only on the weights, the prompts and that seed; vLLM samples from those
streams too). The answer is the generator's: the round's rows, decoded, with its counts. The trainer sends the weights
after each update and the next request right after taking a batch, so the process samples batch k+1 while the trainer
updates on batch k. One thread per process unless trainer.num_threads says.

What travels, and how, so that nothing outlives the processes (a kill -9 of the run leaves nothing in
/dev/shm or /tmp) and a push costs one host copy in the sampler's precision:
- messages go over one pipe, pickled by value (no shared-memory tensors, whose passing needs a socket
  directory in /tmp, and no multiprocessing queues, whose locks are named semaphores in /dev/shm);
- the weights go through one staging buffer, an anonymous memory file (Linux memfd; elsewhere an
  unlinked temporary file) that the process inherits when it starts: the trainer writes each pushed
  tensor into it once, cast to the sampler's dtype in the same copy, and the process copies it into its
  model before answering "loaded"; the trainer writes the next push only after that answer. It is
  ordinary memory, not /dev/shm, so a container's 64 MB /dev/shm does not bound the model size.
"""
from __future__ import annotations

import mmap
import os
import pickle
import signal
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Protocol

import torch

from portagrpo.errors import UserError
from portagrpo.procs import sigint_ignored
from portagrpo.rollout.engines import hf_weight_names
from portagrpo.rollout.generators import Generated, GeneratorInputs, GeneratorSpec, RoundPrompts, make_generator
from portagrpo.rollout.settings import SamplingParams
from portagrpo.rollout.vllm_sampling import seed_streams


class AheadSampler(Protocol):
    """A sampler of its own that generates the next round while the trainer updates (rollout.mode=one_step_off:
    `SamplerProcess`, a process holding a copy of the policy and the run's generator)."""

    holds_weights: ClassVar[bool]

    def submit(self, prompts: RoundPrompts, n: int, params: SamplingParams, width: int, seed: int) -> None:
        """Request a round, generated with the sampler's current weights and `seed`."""

    def result(self) -> Generated:
        """The requested round (waits for it)."""

    def update_weights(self, named_tensors) -> int:
        """The policy after an update, for the next request."""

    def close(self) -> None: ...


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
    engine: str = "hf"  # hf: a SamplerCopy in `precision`; vllm: a VLLMRollout built with the keywords `vllm`
    vllm: dict | None = None
    generator: GeneratorSpec = GeneratorSpec("text")  # the run's generator (rollout/generators/), built here
    rank: int = 0
    local_world_size: int = 1

    @property
    def weights_dtype(self) -> torch.dtype:
        """What the process's copy holds, so what pushes are staged in: the copy's precision, or vLLM's dtype."""
        if self.engine == "vllm":
            return getattr(torch, self.vllm["dtype"])
        from portagrpo.rollout.sampler_copy import SamplerCopy

        return SamplerCopy.PRECISIONS[self.precision]


def vllm_engine_kwargs(settings, backend, policy, eos_ids: list[int], model_path: str, rank: int) -> dict:
    """The keywords the sampler process builds its `VLLMRollout` with: what `VLLMRollout.from_run` gives the
    trainer's engine, for one engine of its own per rank (no tensor parallelism, no sleep: the process has its
    device to itself). What vLLM's build would refuse from inside the process is refused here first, in one
    sentence: the installed versions, the head size, raw log-probs under a correction that needs processed ones."""
    from portagrpo.rollout.vllm import _import_vllm, check_sampler_logprobs, check_versions, fp8_allowed, installed_vllm
    from portagrpo.rollout.vllm_checks import check_head_size
    from portagrpo.rollout.vllm_images import VisionSpec

    if installed_vllm() is None:
        _import_vllm()  # not installed: the import fails, with the install hint
    plugin = backend.spec.vllm_plugin
    check_versions(plugin)
    config = policy.config
    check_head_size(backend, config.get_text_config() if hasattr(config, "get_text_config") else config, settings)
    check_sampler_logprobs(plugin, settings.sampling, settings.correction_uses)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return dict(model_path=model_path, dtype=settings.vllm_dtype, seed=settings.seed + 7919 * rank,
                gpu_memory_utilization=settings.vllm_gpu_memory_utilization, bucket_mb=settings.vllm_weight_bucket_mb,
                max_model_len=settings.max_model_len, tied_embeddings=tied, eos_ids=list(eos_ids), plugin=plugin,
                fp8=fp8_allowed(settings.precision, backend, policy), sleep_mode=False, env=dict(backend.spec.vllm_env),
                vision=VisionSpec.of(policy, model_path, settings.precision))


def _send(conn, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))  # tensors by value


def _recv(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


class _InheritedFd:
    """A file descriptor handed to the spawned process: pickled while it starts, so multiprocessing passes
    the descriptor itself to the new process (no socket, no name)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def anonymous_file(name: str) -> int:
    """A file descriptor of memory with no name in any filesystem: it is freed with the last process
    holding it, however that process ends."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    with tempfile.TemporaryFile(prefix=name) as fh:  # unlinked as soon as it is made
        return os.dup(fh.fileno())


PAGE = mmap.ALLOCATIONGRANULARITY


class Staging:
    """The trainer's side of the weights buffer: one slot per tensor (at a page-aligned offset, so each
    is mapped on its own and the buffer grows while the first push streams in), reused by every push."""

    def __init__(self) -> None:
        self.fd = anonymous_file("portagrpo-sampler-weights")
        self.size = 0
        self.slots: dict[str, tuple[int, torch.Tensor, Any]] = {}  # name -> (offset, view, mapping)

    def _slot(self, name: str, shape: torch.Size, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        held = self.slots.get(name)
        if held is not None and held[1].shape == shape and held[1].dtype == dtype:
            return held[0], held[1]
        nbytes = shape.numel() * dtype.itemsize
        offset = -(-self.size // PAGE) * PAGE
        self.size = offset + nbytes
        if nbytes == 0:
            view, mapping = torch.empty(shape, dtype=dtype), None
        else:
            os.ftruncate(self.fd, self.size)
            mapping = mmap.mmap(self.fd, nbytes, offset=offset)
            view = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        self.slots[name] = (offset, view, mapping)
        return offset, view

    @torch.no_grad()
    def write(self, named: Iterable[tuple[str, torch.Tensor]], float_dtype: torch.dtype) -> list[tuple]:
        """Copy each tensor into its slot (floating tensors cast to `float_dtype` in the same copy); returns
        the layout the process reads them back with: (name, offset, shape, dtype) per tensor."""
        layout = []
        for name, tensor in named:
            dtype = float_dtype if tensor.is_floating_point() else tensor.dtype
            offset, view = self._slot(name, tensor.shape, dtype)
            view.copy_(tensor.detach())
            layout.append((name, offset, tuple(tensor.shape), dtype))
        return layout

    def close(self) -> None:
        self.slots.clear()  # the mappings close once no view holds them
        os.close(self.fd)


class StagedWeights:
    """The process's side of the weights buffer: the whole file mapped once (again when it grew)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.mapped, self.base = fd, 0, None

    def tensors(self, layout: list[tuple], size: int) -> Iterator[tuple[str, torch.Tensor]]:
        if size > self.mapped:
            self.base = torch.frombuffer(mmap.mmap(self.fd, size), dtype=torch.uint8)
            self.mapped = size
        for name, offset, shape, dtype in layout:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            yield name, self.base[offset:offset + nbytes].view(dtype).view(shape)


def _build_sampler(spec: SamplerSpec):
    """(engine, where it samples)."""
    from portagrpo.backends import BACKENDS, load_plugins
    from portagrpo.model.loading import load_model
    from portagrpo.rollout.sampler_copy import SamplerCopy

    load_plugins()
    backend = BACKENDS.get(spec.backend, field="trainer.device")()  # built: the device runtime not yet started
    if spec.engine == "vllm" and spec.device != "cpu":
        # vLLM's single-process executor takes device 0: the process sees only its sampler device, which the runtime
        # honours only when set before it starts (backend.require() below starts it)
        os.environ.update(backend.only_device_env(int(spec.device.rpartition(":")[2] or 0)))  # no device type yet
    backend.require()
    if spec.engine == "vllm":
        return _build_vllm(spec, backend), spec.device
    if spec.device != "cpu":
        backend.set_device(torch.device(spec.device).index)
    # The backend prepares, in this process too, the attention it chose in the trainer's: a vendor kernel it
    # registers with transformers when chosen (Ascend's npu_fusion) exists only in the process that chose it.
    attn = backend.attention_implementation(spec.attn, SamplerCopy.PRECISIONS[spec.precision])
    model = load_model(spec.model_path, attn).to(spec.device)
    engine = SamplerCopy(model, spec.tokenizer, spec.precision, tied_embeddings=spec.tied_embeddings)
    return engine, str(next(engine.master.parameters()).device)


# The launcher's variables, which this process inherits from its rank: vLLM's engine here is a world of its own
# (the uni-process executor), never a member of the trainers' process group.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _build_vllm(spec: SamplerSpec, backend):
    """A vLLM engine on the sampler's device, loaded with the run's initial model through the engine's own push.
    On an accelerator the process sees only that device (`_build_sampler`): vLLM's single-process executor places its
    engine on device 0."""
    from portagrpo.model.loading import load_model
    from portagrpo.rollout.vllm import VLLMRollout

    for name in LAUNCHER_ENV:
        os.environ.pop(name, None)
    engine = VLLMRollout(None, spec.tokenizer, None, **spec.vllm)
    initial = load_model(spec.model_path, spec.attn)  # built with dummy weights: v0 is the run's initial model
    engine.update_weights(initial.state_dict().items())
    del initial
    return engine


def _build_generator(spec: SamplerSpec):
    """The run's generator in this process: the prompts come prepared (no processor needed), the turns are this
    process's own (no lockstep with other ranks)."""
    return make_generator(spec.generator, GeneratorInputs(spec.tokenizer, rank=spec.rank,
                                                          local_world_size=spec.local_world_size,
                                                          log=lambda message: None))


def serve(spec: SamplerSpec, conn, weights_fd: int, parent_pid: int) -> None:
    """The process's loop: ("weights", (layout, size)) | ("generate", (prompts, n, params, width, seed)) |
    ("stop", None)."""
    import multiprocessing

    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    # A spawned interpreter defaults to the spawn start method, under which any multiprocessing lock (tqdm makes
    # one for the progress bars of the model load) is a named semaphore in /dev/shm that a kill -9 leaves behind;
    # under fork it is unlinked as soon as it exists. This process starts no processes of its own.
    multiprocessing.set_start_method("fork", force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to report; it stops this process
    set_parent_death_signal()
    exit_with_parent(parent_pid, "sampler process")
    torch.set_num_threads(spec.threads)
    try:
        engine, device = _build_sampler(spec)
        generator = _build_generator(spec)
        _send(conn, ("ready", device))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which stops with it
        _send(conn, ("error", traceback.format_exc()))
        return
    try:
        _answer(spec, conn, engine, generator, StagedWeights(weights_fd))
    finally:
        generator.close()


def _answer(spec: SamplerSpec, conn, engine, generator, staged: StagedWeights) -> None:
    """Weights and rounds, in the order they come, until the trainer stops the process or goes."""
    while True:
        try:
            kind, payload = _recv(conn)
        except (EOFError, OSError):
            return  # the trainer is gone
        if kind == "stop":
            return
        try:
            if kind == "weights":
                _send(conn, ("loaded", engine.update_weights(staged.tensors(*payload))))
            else:
                prompts, n, params, width, seed = payload
                seed_streams(seed)  # torch's generators (the hf engine's), and Python's and NumPy's (vLLM's too)
                made = generator.generate(engine, prompts.to(spec.device), n, params, width, spec.device)
                _send(conn, ("sampled", made.to("cpu")))
        except BaseException:  # noqa: BLE001
            _send(conn, ("error", traceback.format_exc()))
            return


class SamplerProcess:
    """The trainer's handle on the sampler process: send weights, submit a request, take its result."""

    holds_weights = True
    POLL_S = 1.0

    def __init__(self, spec: SamplerSpec) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or process groups
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.staging = Staging()
        self.dtype = spec.weights_dtype  # what the process's copy holds: pushes come in it
        self.tied = spec.tied_embeddings
        self.process = ctx.Process(target=serve, args=(spec, child_conn, _InheritedFd(self.staging.fd), os.getpid()),
                                   daemon=True, name="portagrpo-sampler")
        with sigint_ignored():
            self.process.start()
        child_conn.close()
        self.waiting = False
        self.pushed = self.loaded = 0
        self._sampled: Generated | None = None
        try:
            self.device = self._until("ready")  # where the process samples, as it reports it
        except BaseException:
            self.close()
            raise

    def _next(self) -> tuple[str, Any]:
        while not self.conn.poll(self.POLL_S):
            if not self.process.is_alive():
                break
        try:
            kind, payload = _recv(self.conn)
        except (EOFError, OSError):
            self.process.join(timeout=5)
            raise UserError(f"the sampler process of rollout.mode=one_step_off exited (code "
                            f"{self.process.exitcode}) without an answer; its error is printed above. "
                            f"Use rollout.mode=sync to sample in the trainer's process.") from None
        if kind == "error":
            raise UserError(f"the sampler process of rollout.mode=one_step_off failed:\n{payload.rstrip()}")
        return kind, payload

    def _until(self, expected: str):
        """Read answers until one of kind `expected`: loads are counted, a result is kept for `result()`."""
        while True:
            kind, payload = self._next()
            if kind == "loaded":
                self.loaded += 1
            elif kind == "sampled":
                self._sampled = payload
            if kind == expected:
                return payload

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the full weights into the staging buffer, once each and in the sampler's precision; the
        process loads them before its next request. Waits until it has loaded the previous push (it has
        by the time the next update ends, unless it is still sampling the batch before)."""
        while self.loaded < self.pushed:
            self._until("loaded")
        layout = self.staging.write(hf_weight_names(named, tied_embeddings=self.tied), self.dtype)
        _send(self.conn, ("weights", (layout, self.staging.size)))
        self.pushed += 1
        return len(layout)

    def submit(self, prompts: RoundPrompts, n: int, params: SamplingParams, width: int, seed: int) -> None:
        if self.waiting:
            raise RuntimeError("one request at a time: take the pending result first")
        _send(self.conn, ("generate", (prompts.to("cpu"), n, params, int(width), int(seed))))
        self.waiting = True

    def result(self) -> Generated:
        if self._sampled is None:
            self._until("sampled")
        sampled, self._sampled = self._sampled, None
        self.waiting = False
        return sampled

    def close(self) -> None:
        if self.conn.closed:
            return
        if self.process.is_alive() and not self.waiting:
            try:
                _send(self.conn, ("stop", None))
            except OSError:
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():  # sampling a batch nobody will take, or stuck: nothing of it is kept
            self.process.kill()
            self.process.join()
        self.conn.close()
        self.staging.close()

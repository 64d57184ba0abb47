"""The parts of the vLLM engine (rollout/vllm.py) that need no vLLM: sampling settings and log-probs as vLLM
takes and returns them, weight buckets, tensor-parallel groups under the external launcher, the random streams,
the sleep pools, the trainer's process state around an engine build and the policy's weights for a reload (the
push into vLLM's CPU build is rollout/vllm_cpu_push.py)."""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from portagrpo.errors import UserError
from portagrpo.rollout.engines import (
    SamplingParams,
    hf_weight_names,
)



def vllm_weight_names(state, *, tied_embeddings: bool):
    """vLLM loads checkpoints by their Hugging Face names (`hf_weight_names`), and a mixture-of-experts policy's
    packed experts by a hub checkpoint's per-expert names (model/moe.py: `per_expert_names`)."""
    from portagrpo.model.moe import per_expert_names

    return per_expert_names(hf_weight_names(state, tied_embeddings=tied_embeddings))

def sampling_kwargs(
    params: SamplingParams, *, seed: int | None, stop_token_ids: list[int], n: int = 1
) -> dict[str, Any]:
    """portagrpo sampling settings as `vllm.SamplingParams` keyword arguments."""
    greedy = params.temperature <= 0
    return {
        "n": n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0 if greedy or params.top_k <= 0 else int(params.top_k),  # 0 is "off" in every version
        "min_p": 0.0 if greedy else float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "max_tokens": int(params.max_tokens),
        "seed": seed,
        "stop_token_ids": list(stop_token_ids),
        "detokenize": False,
        "logprobs": 0,  # the sampled token's own log-prob (0 alternatives); its distribution: LOGPROBS_MODE
    }


# vLLM's sampler reports log-probs "raw" (the model's full softmax, its default) or "processed" (after
# penalties, temperature, min-p and top-k/top-p: the distribution it draws from). The sampler's log-prob
# is the processed one, so the importance ratio against the trainer accounts for truncation (TRL asks
# the same of vLLM). The engine argument exists in every supported version (vllm/config/model.py).
LOGPROBS_MODE = "processed_logprobs"


def raw_is_processed(params: SamplingParams) -> bool:
    """Whether vLLM's raw log-probs (the model's softmax, before penalties and temperature) equal the processed
    ones for these settings: no repetition penalty, and greedy or temperature 1 without truncation."""
    if params.repetition_penalty != 1.0:
        return False
    plain = params.temperature == 1.0 and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
    return params.temperature <= 0 or plain


def sampled_logprobs(output, count: int) -> list[float]:
    """The sampled tokens' log-probs of one vLLM completion (`CompletionOutput.logprobs`: per token, a
    dict from token id to Logprob that always holds the sampled token)."""
    steps = output.logprobs or []
    return [float(step[token].logprob) for token, step in zip(list(output.token_ids)[:count], steps)]


def bucket_tensors(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# The vLLM (and vllm-ascend) releases of ci/matrix.yaml's stacks; a test keeps the two equal.
def tp_layout(size: int, rank: int, world: int, local_world: int, heads: int,
              kv_heads: int | None = None) -> tuple[int, int]:
    """(engine group, rank within it) of a training rank, as vLLM forms tensor-parallel groups from the
    launcher's ranks: consecutive ranks, `arange(world).reshape(-1, ..., tp)` in
    vllm/distributed/parallel_state.py. One sentence for a layout vLLM would refuse or hang on."""
    key = f"rollout.tensor_model_parallel_size={size}"
    if world % size:
        raise UserError(f"{key} does not divide the {world} training rank(s): every rank belongs to exactly one "
                        f"engine; use a divisor of {world}, or more ranks.")
    if local_world % size:
        raise UserError(f"{key} does not divide the {local_world} rank(s) per node: a tensor-parallel group must sit "
                        f"on one node (its all-reduces run every decode step); use a divisor of "
                        f"trainer.nproc_per_node.")
    if heads % size:
        raise UserError(f"{key} does not divide the model's {heads} attention heads, which vLLM splits across the "
                        f"group; use a divisor of {heads}.")
    kv = kv_heads or heads
    if size % kv and kv % size:  # vLLM splits the KV heads, or replicates them over ranks
        raise UserError(f"{key} and the model's {kv} key/value heads must divide one another (vLLM splits or "
                        f"replicates them across the group); use a divisor or a multiple of {kv}.")
    return rank // size, rank % size


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The trainer's process state as it was before vLLM's engine was built in it: vLLM's worker seeds the
    process's generators (`set_random_seed` with the engine's seed: Python's, NumPy's, torch's), and its CPU worker
    sets torch's thread count for its core binding and then replaces `torch.set_num_threads` with a function that
    only warns (vllm/v1/worker/cpu_worker.py). Restored: the host generators' states, torch's thread count and
    `torch.set_num_threads` itself. Not restored: accelerator generators (the trainer seeds every generator before
    each rollout anyway) and the CPU cores vLLM bound its OpenMP threads to."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)


class TensorParallel:
    """This rank's place in its vLLM tensor-parallel group. vLLM's external launcher runs one engine per
    rank and expects every rank of a group to submit the same requests (vllm/v1/executor/uniproc_executor.py:
    "all these engines work together to process the same prompts"), in the same order, and to draw the same
    random numbers (each rank samples for itself; vLLM's torchrun example seeds every rank alike "so that
    sampling can be deterministic across ranks"), so that deterministic scheduling keeps them in step. Each
    training rank has its own prompts and its own random streams: the group's requests are gathered with one
    seed per rank, every rank submits all of them after seeding its streams with the group's first seed, and
    each keeps its own slice. The gather runs within the group only (`group_gather`): a group's prompts, and a
    vision-language policy's raw images with them, never travel to the other groups."""

    def __init__(self, size: int = 1, group: int = 0, rank: int = 0, gather=None) -> None:
        """`gather`: all_gather_object over the group (`group_gather`), or over the world."""
        if size > 1 and gather is None:
            raise ValueError("tensor parallel engines need their group's all_gather_object (group_gather)")
        self.size, self.group, self.rank, self.gather = size, group, rank, gather

    @classmethod
    def of_ranks(cls, size: int, group: int, rank: int, comm) -> "TensorParallel":
        """This rank's place, its requests gathered over its group only (`group_gather`)."""
        return cls(size, group, rank, group_gather(size, comm.rank, comm.world_size) if size > 1 else None)

    def requests(self, local: list) -> tuple[list, slice, int | None]:
        """The group's prompts in rank order, the slice of the outputs that are this rank's, and the seed the
        group's ranks sample with (None for one rank: it samples from its streams as they are)."""
        if self.size == 1:
            return local, slice(0, len(local)), None
        draw = int(torch.randint(0, 2**62, (1,)))  # from this rank's stream, which the trainer seeds per step
        group = self.gather((local, draw))  # the group's ranks in rank order (a world's gather: its group's part)
        if len(group) > self.size:
            group = group[self.group * self.size:(self.group + 1) * self.size]
        start = sum(len(part) for part, _ in group[: self.rank])
        return [p for part, _ in group for p in part], slice(start, start + len(local)), group[0][1]


def group_gather(size: int, rank: int, world: int):
    """`all_gather_object` over this rank's tensor-parallel group only: consecutive ranks, the groups vLLM forms
    (`tp_layout`). Every rank creates every group, in the same order, as torch.distributed requires; the groups run
    on gloo, which carries Python objects through the host whatever the device's collective library is."""
    import torch.distributed as dist

    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)), backend="gloo")
        if first <= rank < first + size:
            mine = group

    def gather(obj):
        out = [None] * size
        dist.all_gather_object(out, obj, group=mine)
        return out

    return gather


def seed_streams(seed: int) -> None:
    """Python's, NumPy's and torch's global generators (torch's on every device), as vLLM's `set_random_seed`
    seeds them; the run's backend seeds them its way (`Backend.seed`), this is for an engine built bare."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def request_groups(requests: list[list[int]], greedy: bool) -> list[tuple[list[int], int]]:
    """Consecutive copies of one prompt (a group's n samples) as one request for that many samples. vLLM refuses
    n > 1 for greedy sampling, whose copies would be identical anyway: one request each there."""
    out: list[tuple[list[int], int]] = []
    for ids in requests:
        if out and not greedy and out[-1][0] == ids:
            out[-1] = (ids, out[-1][1] + 1)
        else:
            out.append((ids, 1))
    return out


class SleepState:
    """Which of vLLM's memory pools are asleep. vLLM's executor ignores `sleep` while any pool still
    sleeps, and a tag-less `wake_up` remaps every pool, mapped or not; so every call here names exactly
    the pools that are asleep, and `sleep` is only called when all of them are awake."""

    POOLS = ("weights", "kv_cache")

    def __init__(self) -> None:
        self.asleep: set[str] = set()

    def to_wake(self, wanted: tuple[str, ...]) -> list[str]:
        return [p for p in wanted if p in self.asleep]


class PolicyWeights:
    """The policy's current weights as the trainer pushes them (train/build.py: push_weights): a LoRA adapter
    merged for the while, each tensor gathered when asked (a sharded policy's gather is a collective, which every
    rank reaches together: ranks generate in step), the tied LM head left out. The engine reloads from it when
    it must generate after a level-2 sleep without a push in between (validation, DAPO's extra rounds)."""

    def __init__(self, scorer: torch.nn.Module, policy: torch.nn.Module, *, lora: bool, tied: bool) -> None:
        self.scorer, self.policy, self.lora, self.tied = scorer, policy, lora, tied

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        if self.lora:
            self.policy.merge_adapter()
        try:
            named = vllm_weight_names(self.scorer.state_dict().items(), tied_embeddings=self.tied)
            yield ((n, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()) for n, t in named)
        finally:
            if self.lora:
                self.policy.unmerge_adapter()


class Counted:
    """The (name, tensor) pairs of a push, passed through once to vLLM's loader, counting them."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named, self.count = named, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in self.named:
            self.count += 1
            yield pair


def check_head_size(backend, config, settings) -> None:
    """One sentence, before vLLM is built, for a head size the backend's vLLM attention lacks (vLLM's CPU attention
    fails inside its first forward otherwise, after the engine was built)."""
    sizes = backend.spec.vllm_head_sizes
    heads = getattr(config, "num_attention_heads", None)
    head = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not sizes or head is None or head in sizes:
        return
    path = settings.model_path
    where = (f"model.path={path} has {head}-wide attention heads" if path else
             f"the built-in model's attention heads are {head} wide (model.tiny.hidden_size="
             f"{settings.tiny_hidden_size} / model.tiny.num_heads={settings.tiny_num_heads})")
    fix = ("use a model with heads of those sizes" if path else
           f"set model.tiny.hidden_size to one of those times model.tiny.num_heads (e.g. "
           f"model.tiny.hidden_size={min(s for s in sizes if s > 0) * settings.tiny_num_heads})")
    raise UserError(f"rollout.engine=vllm on --device {backend.name}: {where}, and vLLM's attention there runs head "
                    f"sizes {', '.join(map(str, sizes))}; {fix}, or use rollout.engine=hf.")


def check_encoder_cache_reset(llm, vision, sleep_mode: bool) -> None:
    """One sentence where an engine that never sleeps would keep serving a vision tower's outputs computed with old
    weights: vLLM keeps them by image across requests (its encoder cache), and only a sleep or
    `LLMEngine.reset_encoder_cache` (vLLM 0.23.0 and 0.33.0 have it, 0.11.0 none) drops them."""
    if vision is None or sleep_mode or hasattr(llm.llm_engine, "reset_encoder_cache"):
        return
    raise UserError("rollout.engine=vllm with a vision-language policy on a platform without sleep mode needs vLLM's "
                    "reset_encoder_cache after every push, which this vLLM lacks (its encoder cache would serve image "
                    "features computed with old weights); install vLLM 0.23 or newer, or use rollout.engine=hf.")

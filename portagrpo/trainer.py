"""The GRPO training loop: setup / step / validate / save / load / close.

The loop orchestrates; the math lives in `portagrpo.algo`, device questions go to the
backend, and every pluggable piece is reached through a registry.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import algo
from .algo.advantages import zero_std_group_fraction
from .algo.losses import masked_mean
from .algo.objective import Objective, Shaping, shape_and_advantage, total_loss
from .backends import BaseBackend, get_backend
from .backends.dist import Collectives, init_collectives
from .batch import RolloutBatch, TrainBatch
from .checkpoint import (CheckpointError, check_checkpoint_fits, latest_valid_checkpoint, load_checkpoint_state,
                         save_checkpoint)
from .config import Config, ConfigError, to_yaml, validate_world
from .data import PromptLoader, PromptRecord, filter_long_prompts, left_pad, load_records, task_records, tokenize_prompts
from .forward import AdaptersOff, ResponseScorer, eval_mode, response_stats
from .kernels import logprob_impl
from .metrics import MetricsLogger
from .modeling import apply_lora, build_tiny_model, check_tiny_matches, load_model, load_tokenizer, resolve_model_path
from .parallel import make_strategy
from .reward_pool import RewardPool
from .rewards import RewardResolver, score_responses
from .run_dir import RunDir, tmp_name
from .rollout import ROLLOUT_ENGINES, SamplingParams, decode_responses, stop_token_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@dataclass
class StepOutput:
    metrics: dict[str, Any]
    batch: TrainBatch
    info: dict[str, Any]


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _seed_for(seed: int, step: int, salt: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**63 - 1)


def shaping_from(cfg: Config) -> Shaping:
    alg = cfg.algorithm
    return Shaping(adv_estimator=alg.adv_estimator, norm_by_std=alg.norm_adv_by_std_in_grpo,
                   reward_clip=alg.reward_clip, shift=alg.reward_norm == "batch" or alg.reward_shift,
                   scale=alg.reward_norm == "batch" or alg.reward_scale,
                   kl_in_reward_coef=alg.kl_coef if alg.use_kl_in_reward else None,
                   whiten=alg.whiten_advantages, advantage_clip=alg.advantage_clip)


def objective_from(cfg: Config) -> Objective:
    a = cfg.actor
    return Objective(clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=a.clip_ratio_c,
                     loss_agg_mode=a.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor,
                     kl_loss_type=a.kl_loss_type if a.use_kl_loss else None, kl_loss_coef=a.kl_loss_coef,
                     entropy_coeff=a.entropy_coeff)


class Trainer:
    def __init__(self, cfg: Config, *, run_dir: str | Path | None = None, resume: str | Path | None = None,
                 log=print, own_outputs: bool = True) -> None:
        """`own_outputs=False` leaves metrics files to a driver (Ray) that collects the metrics."""
        self.cfg = cfg
        self.own_outputs = own_outputs
        self.log = log
        self.run_dir = Path(run_dir or cfg.trainer.output_dir or default_run_dir())
        self.resume_from = resume
        self.step_done = 0

    # ------------------------------------------------------------ setup

    def setup(self) -> "Trainer":
        cfg = self.cfg
        self.backend: BaseBackend = get_backend(cfg.trainer.device)
        self.comm: Collectives = init_collectives(self.backend, cfg.trainer.dist_timeout_s)
        problems = validate_world(cfg, self.comm.world_size)
        if problems:
            raise ConfigError(problems)
        self._set_threads()
        self.backend.set_deterministic(cfg.trainer.deterministic)
        self.backend.seed(cfg.trainer.seed)
        self.device = self.backend.device(self.comm.env.local_rank)
        self.dtype = DTYPES[cfg.model.dtype]
        if not self.backend.supports_dtype(self.dtype):
            raise ConfigError([f"model.dtype={cfg.model.dtype} is not supported on --device {self.backend.name}; use fp32."])
        # Rank 0 names the run directory (a timestamp would differ between processes).
        self.run_dir = Path(self.comm.broadcast_object(str(self.run_dir)))
        self.run = RunDir(self.run_dir)
        if self.comm.is_main:
            if self.own_outputs:  # a Ray driver claims the directory itself
                self.run.claim(resuming=self.resume_from is not None, log=self.log)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run.config.write_text(to_yaml(cfg))
        self.strategy = make_strategy(self.backend.parallel_strategy(cfg.trainer.parallel), self.comm)
        self.kernel_name = self.backend.kernel_implementation(cfg.kernels.logprob)
        self.kernel = logprob_impl(self.kernel_name)
        self._setup_data()
        self._setup_models()
        self._setup_optimizer()
        self.engine = self._make_engine()
        resume_step = self._maybe_resume()
        if resume_step:
            self.push_weights_to_engine()  # the engine loaded the initial weights
        self.logger = (MetricsLogger(self.run_dir, tensorboard=cfg.trainer.tensorboard, resume_step=resume_step,
                                     warn=self.log)
                       if self.comm.is_main and self.own_outputs else None)
        return self

    def _make_engine(self):
        cfg = self.cfg
        name = self.backend.rollout_engine(cfg.rollout.engine)
        if name == "vllm":
            from . import rollout_vllm  # noqa: F401 - registers the engine; imports vLLM only when built
        engine_cls = ROLLOUT_ENGINES.get(name, field="rollout.engine")
        extra: dict[str, Any] = {}
        if name == "fixed":
            extra = {"n": cfg.rollout.n}
        elif name == "vllm":
            r = cfg.rollout
            extra = {"model_path": str(resolve_model_path(cfg.model.path) if cfg.model.path else self.run_dir / "init_model"),
                     "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp64": "float32"}[cfg.model.dtype],
                     "seed": cfg.trainer.seed + 7919 * self.comm.rank,
                     "gpu_memory_utilization": r.vllm_gpu_memory_utilization, "bucket_mb": r.vllm_weight_bucket_mb,
                     "max_model_len": r.vllm_max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
                     "tied_embeddings": bool(getattr(self.policy.config, "tie_word_embeddings", False)),
                     "empty_cache": self.backend.empty_cache, "world_size": self.comm.world_size,
                     "eos_ids": stop_token_ids(self.tokenizer, self.policy)}
        return engine_cls(self.scorer, self.tokenizer, self.autocast, self.strategy.generate_kwargs, **extra)

    def push_weights_to_engine(self) -> None:
        """Engines that keep their own copy of the weights (vLLM) get the updated policy, with any
        LoRA adapter merged in; gathering a sharded policy is a collective on every rank."""
        if not hasattr(self.engine, "update_weights"):
            return
        merge = self.is_lora
        if merge:
            self.policy.merge_adapter()
        try:
            state = self.strategy.model_state_everywhere(self.scorer)
        finally:
            if merge:
                self.policy.unmerge_adapter()
        self.engine.update_weights(state)

    def _set_threads(self) -> None:
        threads = self.cfg.trainer.num_threads
        if threads is None and self.comm.world_size > 1 and self.device_is_cpu:
            # Processes sharing the cores must not each start a thread per core (many-fold slowdown).
            threads = max(1, (os.cpu_count() or 1) // self.comm.env.local_world_size)
        if threads:
            torch.set_num_threads(threads)

    @property
    def device_is_cpu(self) -> bool:
        return self.backend.device_type == "cpu"

    def autocast(self):
        return self.backend.autocast(self.dtype)

    @property
    def master_dtype(self) -> torch.dtype:
        """Weights and optimizer state: fp64 for the fp64 reference, else fp32 (bf16 is compute only)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def _setup_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        if cfg.data.task:
            train = task_records(cfg.data.task, cfg.data.train_size, cfg.trainer.seed)
            val = task_records(cfg.data.task, cfg.data.val_size, cfg.trainer.seed + 10_007)
        else:
            train = load_records(cfg.data.train_files)
            val = load_records(cfg.data.val_files) if cfg.data.val_files else []
        train, dropped = filter_long_prompts(self.tokenizer, train, cfg.data.max_prompt_length)
        val, dropped_val = filter_long_prompts(self.tokenizer, val, cfg.data.max_prompt_length)
        if dropped or dropped_val:
            self.log(f"dropped {dropped} train and {dropped_val} val prompts longer than data.max_prompt_length="
                     f"{cfg.data.max_prompt_length} tokens")
        self.reward = RewardResolver(cfg.reward.function)
        self.reward_pool = (RewardPool(cfg.reward.function, cfg.reward.num_workers, cfg.reward.timeout_s)
                            if cfg.reward.num_workers > 0 else None)
        self.reward.check_sources({r.data_source for r in train + val})
        self.loader = PromptLoader(train, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.val_records = val

    def _setup_models(self) -> None:
        cfg = self.cfg
        attn = self.backend.attention_implementation(cfg.model.attn_implementation, self.dtype)
        init_dir = self.run_dir / "init_model"
        if cfg.model.path:
            self.policy = load_model(cfg.model.path, attn)
            ref_path = cfg.model.ref_path or cfg.model.path
        else:
            if self.comm.is_main and not (init_dir / "config.json").is_file():
                # written whole or not at all: a kill here must leave a run that can start again
                tmp = tmp_name(init_dir)
                model = build_tiny_model(cfg.model, self.tokenizer, cfg.trainer.seed)
                model.save_pretrained(tmp, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                os.replace(tmp, init_dir)
            self.comm.barrier()
            check_tiny_matches(cfg.model.tiny, init_dir)
            self.policy = load_model(init_dir, attn)
            ref_path = cfg.model.ref_path or init_dir
        self.policy.to(device=self.device, dtype=self.master_dtype)
        self.is_lora = cfg.model.lora.rank > 0
        if self.is_lora:
            self.policy = apply_lora(self.policy, cfg.model.lora).to(device=self.device, dtype=self.master_dtype)
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.policy.config.use_cache = True
        self.scorer = self.strategy.wrap(ResponseScorer(self.policy, self.kernel), trainable=True)
        self.ref = self.ref_scorer = None
        if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and self.is_lora:
            self.ref_scorer = AdaptersOff(self.scorer)
        elif cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            self.ref = load_model(ref_path, attn).to(device=self.device, dtype=self.master_dtype).eval()
            self.ref.requires_grad_(False)
            self.ref_scorer = self.strategy.wrap(ResponseScorer(self.ref, self.kernel), trainable=False)
        self.kl_needs_vocab = cfg.actor.kl_loss_type.rstrip("+") == "full"
        self.shaping, self.objective = shaping_from(cfg), objective_from(cfg)

    def _setup_optimizer(self) -> None:
        a = self.cfg.actor
        self.params = [p for p in self.scorer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay)
        total = self.total_steps

        def schedule(step: int) -> float:
            if a.warmup_steps and step < a.warmup_steps:
                return step / a.warmup_steps  # verl's convention: from 0 at the first step
            if a.lr_schedule == "cosine":
                progress = (step - a.warmup_steps) / max(1, total - a.warmup_steps)
                return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            return 1.0

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    @property
    def on_policy(self) -> bool:
        """One update on the whole batch: the policy that sampled is the one being updated, so the
        old log-probs are the update's own (detached) and their separate pass is skipped, as in
        verl. A KL-in-reward needs old log-probs before the update, so it keeps the pass."""
        a = self.cfg.actor
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.cfg.rollout_batch_size
                and not self.cfg.algorithm.use_kl_in_reward)

    @property
    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_steps if t.total_steps is not None else t.total_epochs * self.loader.batches_per_epoch

    # ------------------------------------------------------------ save / load

    def rng_state(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "backend": self.backend.rng_state()}

    def set_rng_state(self, rng: dict[str, Any]) -> None:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.backend.set_rng_state(rng.get("backend", {}))

    def save(self) -> Path:
        # Gathering full state dicts is a collective: every rank takes part, rank 0 writes.
        model_state = self.strategy.model_state(self.scorer)
        optimizer_state = self.strategy.optimizer_state(self.scorer, self.optimizer)
        path = None
        if self.comm.is_main:
            path = save_checkpoint(
                self.run_dir, self.step_done, model=self.policy, tokenizer=self.tokenizer, model_state=model_state,
                optimizer_state=optimizer_state, scheduler=self.scheduler,
                state={"loader": self.loader.state_dict(), "world_size": self.comm.world_size},
                rng=self.rng_state(), keep=self.cfg.trainer.max_ckpt_to_keep,
            )
            self.log(f"saved checkpoint {path}")
        self.comm.barrier()
        return path

    def _maybe_resume(self) -> int:
        if self.resume_from is None:
            return 0
        target = Path(self.resume_from)
        if (target / "manifest.json").exists() or target.name.startswith("step_"):
            ckpt = target
        else:
            ckpt = latest_valid_checkpoint(target, warn=self.log)
            if ckpt is None:
                raise CheckpointError(f"--resume {str(target)!r}: no whole checkpoint found under {target}/checkpoints.")
        check_checkpoint_fits(ckpt, self.policy.config, self.cfg.model.lora.rank)
        parts = load_checkpoint_state(ckpt)
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(parts["model_dir"]).glob("*.safetensors")):
            state.update(load_file(f))
        if self.is_lora:
            self._load_adapter(ckpt, state)
        else:
            self._load_full(ckpt, state)
        self.strategy.load_optimizer_state(self.scorer, self.optimizer, parts["optimizer"])
        self.scheduler.load_state_dict(parts["scheduler"])
        self.loader.load_state_dict(parts["state"]["loader"])
        self.set_rng_state(parts["rng"])
        self.step_done = int(parts["state"]["step"])
        self.log(f"resumed from {ckpt} at step {self.step_done}")
        return self.step_done

    def _load_adapter(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.policy, state)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if not state or unexpected:
            raise CheckpointError(f"checkpoint {ckpt} does not hold this run's LoRA adapter (unexpected {unexpected[:3]}).")

    def _load_full(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.policy.state_dict())  # parameter names (sharded or not)
        tied = {"lm_head.weight"} if getattr(self.policy.config, "tie_word_embeddings", False) else set()
        missing = sorted(expected - set(state) - tied)
        unexpected = sorted(set(state) - expected - {"lm_head.weight"})
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {ckpt} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]}).")
        self.strategy.load_model_state(self.scorer, state)

    # ------------------------------------------------------------ one step

    def local_records(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's share of the global prompt batch (whole prompts, so whole groups)."""
        per = len(records) // self.comm.world_size
        return records[self.comm.rank * per:(self.comm.rank + 1) * per]

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int,
                prompt_width: int | None = None) -> RolloutBatch:
        ids = tokenize_prompts(self.tokenizer, records)
        ids = [x for x in ids for _ in range(n)]
        prompt_ids, prompt_mask = left_pad(ids, self.engine.pad_id, width=prompt_width)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        responses, mask = self.engine.generate(prompt_ids, prompt_mask, params)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=responses, response_mask=mask,
            uid=torch.arange(len(records), device=self.device).repeat_interleave(n) + uid_base,
            prompt_index=torch.tensor(rep([r.index for r in records]), device=self.device),
            response_text=decode_responses(self.tokenizer, responses, mask),
            ground_truth=rep([r.ground_truth for r in records]), data_source=rep([r.data_source for r in records]),
            extra_info=rep([r.extra_info for r in records]),
        )

    def sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(self.cfg.data.max_response_length, temperature, r.top_p, r.top_k, r.min_p,
                              r.repetition_penalty)

    def prompt_width(self, records: list[PromptRecord]) -> int:
        """One left-padded prompt width for all ranks, so rollouts can be gathered."""
        local = max(len(x) for x in tokenize_prompts(self.tokenizer, records))
        return int(self.comm.all_reduce_max(torch.tensor(local, device=self.device)))

    def score(self, batch: RolloutBatch):
        return score_responses(
            self.reward, batch.response_text, batch.ground_truth, batch.data_source, batch.prompt_index.tolist(),
            batch.extra_info, max_error_frac=self.cfg.reward.max_error_frac, pool=self.reward_pool,
        )

    @torch.no_grad()
    def logprobs(self, scorer, batch: RolloutBatch, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, T] (and entropy) of `scorer`'s model over the batch, in micro-batches."""
        mb = self.cfg.actor.micro_batch_size
        logps, ents = [], []
        with eval_mode(scorer):  # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
            for start in range(0, batch.size, mb):
                part = batch.select(list(range(start, min(start + mb, batch.size))))
                stats = response_stats(scorer, part, temperature=self.cfg.rollout.temperature, compute_entropy=entropy,
                                       autocast=self.autocast)
                logps.append(stats.logp)
                if entropy:
                    ents.append(stats.entropy)
        return torch.cat(logps), (torch.cat(ents) if entropy else None)

    def gather(self, rb: RolloutBatch, tensors: dict[str, torch.Tensor | None]) -> tuple[RolloutBatch, dict]:
        """The global batch, identical on every rank, in rank order (one process: unchanged)."""
        if self.comm.world_size == 1:
            return rb, tensors
        g = self.comm.all_gather_cat
        full = RolloutBatch(
            prompt_ids=g(rb.prompt_ids), prompt_mask=g(rb.prompt_mask), responses=g(rb.responses),
            response_mask=g(rb.response_mask), uid=g(rb.uid), prompt_index=g(rb.prompt_index),
            response_text=[], ground_truth=[], data_source=[], extra_info=[],
        )
        return full, {k: (None if v is None else g(v)) for k, v in tensors.items()}

    def advantages(self, batch: RolloutBatch, scores: torch.Tensor, old_logp, ref_logp) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward shaping then the group advantage (algo.objective). Returns (scores', advantages [B, T])."""
        return shape_and_advantage(scores, batch.uid, batch.response_mask, self.shaping, old_logp=old_logp,
                                   ref_logp=ref_logp)

    def micro_loss(self, micro: TrainBatch, num_tokens, num_seqs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, cfg = self.cfg.actor, self.cfg
        rb, mask = micro.rollout, micro.rollout.response_mask
        full_kl = self.kl_needs_vocab and a.use_kl_loss
        on_policy = micro.old_logp is None
        stats = response_stats(self.scorer, rb, temperature=cfg.rollout.temperature,
                               compute_entropy=a.entropy_coeff != 0 or on_policy, vocab=full_kl, autocast=self.autocast)
        logp = stats.logp  # fp32 (fp64 for an fp64 model): kernels never return bf16
        old = logp.detach() if on_policy else micro.old_logp  # on-policy: the policy that sampled is this one
        loss, m = total_loss(logp, old, micro.advantages, mask, self.objective, num_tokens=num_tokens,
                             num_seqs=num_seqs, ref_logp=micro.ref_logp, entropy=stats.entropy,
                             logp_vocab=stats.logp_vocab, ref_logp_vocab=self._ref_vocab(rb) if full_kl else None)
        if on_policy:  # the entropy metric comes from this forward (no separate scoring pass ran)
            m["entropy"] = masked_mean(stats.entropy.detach(), mask)
        return loss, m

    @torch.no_grad()
    def _ref_vocab(self, batch: RolloutBatch) -> torch.Tensor:
        with eval_mode(self.ref_scorer):
            return response_stats(self.ref_scorer, batch, temperature=self.cfg.rollout.temperature,
                                  compute_entropy=False, vocab=True, autocast=self.autocast).logp_vocab

    def update(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """ppo_epochs over shuffled mini-batches of the global batch; each rank takes its slice of
        every mini-batch and accumulates gradients over micro-batches."""
        a = self.cfg.actor
        g = torch.Generator().manual_seed(_seed_for(self.cfg.trainer.seed, step, 2))
        per_rank = a.ppo_mini_batch_size // self.comm.world_size
        sums: dict[str, torch.Tensor] = {}
        grad_norms = []
        self.scorer.train()
        for _ in range(a.ppo_epochs):
            order = torch.randperm(batch.rollout.size, generator=g)
            for mini_idx in order.split(a.ppo_mini_batch_size):
                mine = batch.select(mini_idx[self.comm.rank * per_rank:(self.comm.rank + 1) * per_rank])
                # Counts are whole numbers: reduced exactly as int64 (no vendor reduces float64 everywhere).
                counts = torch.stack(algo.loss_normalizers(mine.rollout.response_mask)).round().long()
                n_tok, n_seq = self.comm.all_reduce_sum(counts).to(torch.float64).unbind()
                self.optimizer.zero_grad(set_to_none=True)
                for micro_idx in torch.arange(per_rank).split(a.micro_batch_size):
                    micro = mine.select(micro_idx)
                    loss, m = self.micro_loss(micro, n_tok, n_seq)
                    loss.backward()
                    self._accumulate(sums, m, float(micro.rollout.response_mask.sum()))
                self.strategy.sync_grads(self.params)
                grad_norms.append(self._clip_and_step())
        n_updates = a.ppo_epochs * (batch.rollout.size // a.ppo_mini_batch_size)
        return self._reduce_update_metrics(sums, n_updates, grad_norms)

    @staticmethod
    def _accumulate(sums: dict[str, torch.Tensor], m: dict[str, torch.Tensor], tokens: float) -> None:
        """Loss terms already carry their share of the mini-batch: sum them. Other metrics are
        token-weighted means: sum value * tokens and the tokens."""
        for k, v in m.items():
            value = v.detach().double()
            if k.startswith("loss_"):
                sums[k] = sums.get(k, 0.0) + value
            else:
                sums[k] = sums.get(k, 0.0) + value * tokens
                sums[k + "/w"] = sums.get(k + "/w", 0.0) + tokens

    def _reduce_update_metrics(self, sums, n_updates: int, grad_norms: list[float]) -> dict[str, float]:
        keys = sorted(sums)
        values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=self.device) for k in keys])
        total = dict(zip(keys, self.comm.sum_on_host(values).tolist()))  # exact fp64, never an fp64 collective
        out = {}
        for k, v in total.items():
            if k.endswith("/w"):
                continue
            out[k] = v / n_updates if k.startswith("loss_") else v / max(total[k + "/w"], 1.0)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return out

    def _clip_and_step(self) -> float:
        norm = self.strategy.clip_grad_norm(self.params, self.cfg.actor.grad_clip)
        if torch.isfinite(norm):
            self.optimizer.step()
        else:
            self.log(f"step {self.step_done + 1}: gradient norm is {float(norm)}, optimizer step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def make_batch(self, step: int) -> tuple[TrainBatch, dict[str, Any]]:
        """Rollout, reward, log-probs and advantages for one step; returns the global batch."""
        cfg = self.cfg
        records = self.local_records(self.loader.next_batch())
        width = self.prompt_width(records)
        self.backend.seed(_seed_for(cfg.trainer.seed, step, 1 + 10 * self.comm.rank))
        params = self.sampling(cfg.rollout.temperature)
        uid_base = (step * cfg.data.train_batch_size) + self.comm.rank * len(records)
        rb = self.rollout(records, cfg.rollout.n, params, uid_base=uid_base, prompt_width=width)
        t_gen = time.perf_counter()
        scored = self.score(rb)
        for failure in scored.failures[:3]:
            self.log(f"step {step}: reward failed on sample {failure.sample} (prompt id {failure.prompt_id}): {failure.message}")
        old_logp, entropy = self.logprobs(self.scorer, rb, entropy=True) if not self.on_policy else (None, None)
        ref_logp = self.logprobs(self.ref_scorer, rb, entropy=False)[0] if self.ref_scorer is not None else None
        local = {
            "scores": torch.tensor(scored.scores, dtype=torch.float32, device=self.device),
            "correct": torch.tensor(scored.correct, dtype=torch.float32, device=self.device),
            "errors": torch.tensor([float(len(scored.failures))], device=self.device),
            "old": old_logp, "ref": ref_logp, "entropy": entropy,
        }
        full_rb, t = self.gather(rb, local)
        scores, adv = self.advantages(full_rb, t["scores"], t["old"], t["ref"])
        info = {"raw_scores": t["scores"], "scores": scores, "correct": t["correct"], "entropy": t["entropy"],
                "reward_errors": float(t["errors"].sum()), "t_gen": t_gen}
        return TrainBatch(full_rb, adv, t["old"], t["ref"]), info

    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        self.backend.reset_peak_memory()
        batch, info = self.make_batch(self.step_done + 1)
        out = self.train_on(batch, info, t0)
        if self.cfg.trainer.record_rollouts:
            self.record(out)
        return out

    def batch_from_record(self, rec: dict[str, Any]) -> tuple[TrainBatch, dict[str, Any]]:
        """Rebuild a recorded step's global batch on this backend: log-probs and advantages are
        recomputed here; rollout tokens and rewards are exactly the recorded ones."""
        d, t_start = self.device, time.perf_counter()
        rb = RolloutBatch(prompt_ids=rec["prompt_ids"].to(d), prompt_mask=rec["prompt_mask"].to(d),
                          responses=rec["responses"].to(d), response_mask=rec["response_mask"].to(d),
                          uid=rec["uid"].to(d), prompt_index=rec["prompt_index"].to(d), response_text=[],
                          ground_truth=[], data_source=[], extra_info=[])
        old_logp, entropy = self.logprobs(self.scorer, rb, entropy=True) if not self.on_policy else (None, None)
        ref_logp = self.logprobs(self.ref_scorer, rb, entropy=False)[0] if self.ref_scorer is not None else None
        raw = rec["scores"].to(d)
        scores, adv = self.advantages(rb, raw, old_logp, ref_logp)
        info = {"raw_scores": raw, "scores": scores, "correct": rec["correct"].to(d), "entropy": entropy,
                "reward_errors": 0.0, "t_gen": t_start}  # nothing generated: time_gen_s is 0
        return TrainBatch(rb, adv, old_logp, ref_logp), info

    def record(self, out: StepOutput) -> None:
        """Save this step's rollout, metrics and parameter fingerprint (rank 0 writes)."""
        fingerprint = self.param_fingerprint()
        if not self.comm.is_main:
            return
        rb = out.batch.rollout
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        record = {k: v.detach().cpu() for k, v in rb.tensors().items() if torch.is_tensor(v)}
        record.update(scores=out.info["raw_scores"].cpu(), correct=out.info["correct"].cpu(),
                      metrics=out.metrics, fingerprint=fingerprint,
                      setting={"device": self.backend.name, "dtype": self.cfg.model.dtype, "kernel": self.kernel_name})
        tmp = folder / f".step_{out.metrics['step']:08d}.pt.tmp"
        torch.save(record, tmp)
        os.replace(tmp, folder / f"step_{out.metrics['step']:08d}.pt")

    def param_fingerprint(self) -> dict[str, list[float]]:
        """Per parameter tensor: (sum, sum of squares) in fp64. Both add up over shards, so the
        fingerprint is exact under FSDP2 too; replay compares it to measure parameter drift."""
        names, values = [], []
        for name, p in self.scorer.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            x = local.detach().double()
            names.append(name.removeprefix("lm."))
            values.append(torch.stack([x.sum(), (x * x).sum()]))
        sharded = any(hasattr(p, "to_local") for p in self.scorer.parameters())
        if not values:
            total = torch.zeros(0, 2, dtype=torch.float64)
        elif sharded:  # FSDP2 shards add up to the whole tensor
            total = self.comm.sum_on_host(torch.stack(values))
        else:  # every rank holds the whole model: summing over ranks would count it world_size times
            total = torch.stack(values).cpu()
        return {n: v.tolist() for n, v in zip(names, total)}

    def train_on(self, batch: TrainBatch, info: dict[str, Any], t0: float) -> StepOutput:
        step = self.step_done + 1
        t_prep = time.perf_counter()
        lr_used = self.scheduler.get_last_lr()[0]
        upd = self.update(batch, step)
        self.scheduler.step()
        self.push_weights_to_engine()
        self.backend.synchronize()
        t_end = time.perf_counter()
        self.step_done = step
        rb, adv, raw = batch.rollout, batch.advantages, info["raw_scores"]
        mask = rb.response_mask
        resp_tokens = float(mask.sum())
        peak = torch.tensor(self.backend.peak_memory_gb(), dtype=torch.float32, device=self.device)
        metrics = {
            "step": step,
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.detach().cpu().double().std()) if raw.numel() > 1 else 0.0,  # no fp32 overflow
            "acc": float(info["correct"].mean()),
            "score_mean": float(info["scores"].mean()),
            "adv_mean": float(masked_mean(adv, mask)),
            "adv_std": float(masked_mean((adv - masked_mean(adv, mask)) ** 2, mask).sqrt()),
            "loss_policy": upd.get("loss_policy", 0.0),
            # kl only with a reference model, loss_kl only with a KL loss: never a made-up 0
            **{k: upd[k] for k in ("loss_kl", "kl") if k in upd},
            "entropy": upd["entropy"] if info["entropy"] is None else float(masked_mean(info["entropy"], mask)),
            "clipfrac": upd["clipfrac"],
            "clipfrac_lower": upd["clipfrac_lower"],
            "ppo_kl": upd["ppo_kl"],
            "ratio_mean": upd["ratio_mean"],
            "grad_norm": upd["grad_norm"],
            "response_len_mean": resp_tokens / rb.size,
            # share of responses that hit data.max_response_length (verl's response_length/clip_ratio)
            "response_clip_ratio": float((mask.sum(dim=1) >= mask.shape[1]).float().mean()),
            "zero_std_group_frac": float(zero_std_group_fraction(raw, rb.uid)),
            "reward_errors": info["reward_errors"],
            "lr": lr_used,
            "time_step_s": t_end - t0,
            "time_gen_s": info["t_gen"] - t0,
            "time_prep_s": t_prep - info["t_gen"],
            "time_update_s": t_end - t_prep,
            # response tokens of all ranks per second of step time (the batch's generation + training rate)
            "response_tokens_per_s": resp_tokens / (t_end - t0),
            # verl's perf/throughput: prompt + response tokens / (step time x devices)
            "tokens_per_s_per_device": (resp_tokens + float(rb.prompt_mask.sum())) / ((t_end - t0) * self.comm.world_size),
            "mem_peak_gb": float(self.comm.all_reduce_max(peak)),
            "world_size": self.comm.world_size,
        }
        return StepOutput(metrics, batch, info)

    # ------------------------------------------------------------ validation

    def validate(self) -> dict[str, float]:
        """Held-out mean reward and accuracy; the split is shared across ranks and reduced."""
        if not self.val_records:
            return {}
        cfg = self.cfg
        params = self.sampling(cfg.rollout.val_temperature)
        state = torch.get_rng_state()  # validation must not shift the training RNG stream
        self.backend.seed(_seed_for(cfg.trainer.seed, self.step_done, 3 + 10 * self.comm.rank))
        world, rank = self.comm.world_size, self.comm.rank
        per = -(-len(self.val_records) // world)
        mine = self.val_records[rank * per:(rank + 1) * per]
        weights = [1.0] * len(mine) + [0.0] * (per - len(mine))
        mine = mine + [self.val_records[0]] * (per - len(mine))  # equal work per rank; padding weighs 0
        bs = max(cfg.data.train_batch_size // world, 1)
        k = cfg.rollout.val_n
        totals = torch.zeros(4, dtype=torch.float64)  # score sum, correct sum, samples, prompts solved (pass@k)
        for start in range(0, per, bs):
            records = mine[start:start + bs]
            rb = self.rollout(records, k, params, uid_base=0, prompt_width=self.prompt_width(records))
            s = self.score(rb)
            w = torch.tensor(weights[start:start + bs], dtype=torch.float64)
            scores = torch.tensor(s.scores, dtype=torch.float64).view(-1, k)
            correct = torch.tensor(s.correct, dtype=torch.float64).view(-1, k)
            totals += torch.stack([(w[:, None] * scores).sum(), (w[:, None] * correct).sum(), w.sum() * k,
                                   (w * correct.max(dim=1).values).sum()])
        torch.set_rng_state(state)
        score_sum, correct_sum, count, solved = self.comm.sum_on_host(totals).tolist()
        out = {"val/reward_mean": score_sum / count, "val/acc": correct_sum / count}
        if k > 1:
            out[f"val/pass@{k}"] = solved / (count / k)
        return out

    # ------------------------------------------------------------ the run

    def fit(self, progress: bool | None = None) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        t = self.cfg.trainer
        show = (t.progress_bar if progress is None else progress) and self.comm.is_main
        bar = tqdm(total=self.total_steps, initial=self.step_done, disable=not show, dynamic_ncols=True, desc="grpo")
        history = []
        try:
            if t.test_freq and self.step_done == 0:
                self._log_val_only()
            while self.step_done < self.total_steps:
                metrics = self.step().metrics
                if t.test_freq and (self.step_done % t.test_freq == 0 or self.step_done == self.total_steps):
                    metrics.update(self.validate())
                if self.logger is not None:
                    self.logger.log(metrics)
                history.append(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss_policy']:.3f}",
                                tok_s=f"{metrics['response_tokens_per_s']:.0f}")
                if t.save_freq and (self.step_done % t.save_freq == 0 or self.step_done == self.total_steps):
                    self.save()
        finally:
            bar.close()
        return history

    def _log_val_only(self) -> None:
        val = self.validate()
        if val and self.comm.is_main:
            self.log("step 0 validation: " + ", ".join(f"{k}={v:.3f}" for k, v in val.items()))
        self.initial_val = val

    def close(self) -> None:
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
        if getattr(self, "logger", None) is not None:
            if self.cfg.trainer.plot:
                self.logger.plot()
            self.logger.close()
        if getattr(self, "comm", None) is not None:
            self.comm.close()
        if getattr(self, "run", None) is not None:
            self.run.unlock()

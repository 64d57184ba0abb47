"""Building what a run needs from its config: data, reward, models, optimizer and the rollout engine."""
from __future__ import annotations

import functools
import os

import torch

from portagrpo.algo.schedule import lr_multiplier
from portagrpo.backends import Backend
from portagrpo.config import Config
from portagrpo.data.records import PromptLoader, filter_long_prompts, load_records, task_records
from portagrpo.fileio import atomic_path
from portagrpo.model.loading import apply_lora, build_tiny_model, check_tiny_matches, load_model, load_tokenizer
from portagrpo.model.scorer import AdaptersOff, ResponseScorer
from portagrpo.rewards.functions import RewardResolver
from portagrpo.rewards.pool import RewardPool
from portagrpo.rollout.engines import ROLLOUT_ENGINES, EngineInputs
from portagrpo.train.update import objective_from, shaping_from


class Builder:
    """Setup helpers of the Trainer (see loop.py); each reads `self.cfg` and sets attributes."""

    cfg: Config
    backend: Backend

    def _setup_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                                        "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
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
                model = build_tiny_model(cfg.model, self.tokenizer, cfg.trainer.seed)
                with atomic_path(init_dir, directory=True, what="writing the initial model to") as tmp:
                    model.save_pretrained(tmp, safe_serialization=True)
                    self.tokenizer.save_pretrained(tmp)
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
        self.scorer = self.strategy.wrap(
            ResponseScorer(self.policy, self.kernel), trainable=True, compute_dtype=self.dtype
        )
        self.ref = self.ref_scorer = None
        if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and self.is_lora:
            self.ref_scorer = AdaptersOff(self.scorer)
        elif cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            self.ref = (
                load_model(ref_path, attn, "model.ref_path" if cfg.model.ref_path else "model.path")
                .to(device=self.device, dtype=self.master_dtype)
                .eval()
            )
            self.ref.requires_grad_(False)
            self.ref_scorer = self.strategy.wrap(
                ResponseScorer(self.ref, self.kernel), trainable=False, compute_dtype=self.dtype
            )
        self.kl_needs_vocab = cfg.actor.kl_loss_type.rstrip("+") == "full"
        self.shaping, self.objective = shaping_from(cfg), objective_from(cfg)

    def _setup_optimizer(self) -> None:
        a = self.cfg.actor
        self.params = [p for p in self.scorer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay)
        schedule = functools.partial(lr_multiplier, warmup_steps=a.warmup_steps, total_steps=self.total_steps,
                                     kind=a.lr_schedule)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def _make_engine(self):
        name = self.backend.rollout_engine(self.cfg.rollout.engine)
        return ROLLOUT_ENGINES.get(name, field="rollout.engine").from_run(EngineInputs(
            cfg=self.cfg, scorer=self.scorer, policy=self.policy, tokenizer=self.tokenizer, autocast=self.autocast,
            generate_kwargs=self.strategy.generate_kwargs, backend=self.backend, rank=self.comm.rank,
            world_size=self.comm.world_size, init_model_dir=self.run_dir / "init_model"))

    def push_weights_to_engine(self) -> None:
        """Engines that keep their own copy of the weights (vLLM) get the updated policy, with any
        LoRA adapter merged in; gathering a sharded policy is a collective on every rank."""
        if not self.engine.holds_weights:
            return
        merge = self.is_lora
        if merge:
            self.policy.merge_adapter()
        try:  # one parameter gathered at a time, loaded bucket by bucket and freed (never the whole model at once)
            self.engine.update_weights(self.strategy.full_tensors(self.scorer))
        finally:
            if merge:
                self.policy.unmerge_adapter()

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

    @property
    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_steps if t.total_steps is not None else t.total_epochs * self.loader.batches_per_epoch

"""The update: epochs, mini-batches and micro-batches over one Experience, and the step's metrics."""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from portagrpo import algo
from portagrpo.algo.advantages import zero_std_group_fraction
from portagrpo.algo.losses import masked_mean
from portagrpo.algo.objective import Objective, Shaping, total_loss
from portagrpo.batch import RolloutBatch, TrainBatch
from portagrpo.config import Config
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.train.experience import Experience, seed_for


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


class Updater:
    """Update methods of the Trainer (see loop.py)."""

    def train_on(self, exp: Experience, t0: float) -> dict[str, Any]:
        """Update on `exp`, push the weights to the engine, and return the step's metrics."""
        step = self.step_done + 1
        t_prep = time.perf_counter()
        lr_used = self.scheduler.get_last_lr()[0]
        with self.backend.region("update"):
            upd = self.update(exp.batch, step)
        self.scheduler.step()
        with self.backend.region("push weights"):
            self.push_weights_to_engine()
        self.backend.synchronize()
        t_end = time.perf_counter()
        self.step_done = step
        rb, adv, raw = exp.batch.rollout, exp.batch.advantages, exp.raw_scores
        mask = rb.response_mask
        resp_tokens = float(mask.sum())
        peak = torch.tensor(self.backend.peak_memory_gb(), dtype=torch.float32, device=self.device)
        metrics = {
            "step": step,
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.detach().cpu().double().std()) if raw.numel() > 1 else 0.0,  # no fp32 overflow
            "acc": float(exp.correct.mean()),
            "score_mean": float(exp.scores.mean()),
            "adv_mean": float(masked_mean(adv, mask)),
            "adv_std": float(masked_mean((adv - masked_mean(adv, mask)) ** 2, mask).sqrt()),
            "loss_policy": upd.get("loss_policy", 0.0),
            # kl only with a reference model, loss_kl only with a KL loss: never a made-up 0
            **{k: upd[k] for k in ("loss_kl", "kl") if k in upd},
            "entropy": upd["entropy"] if exp.entropy is None else float(masked_mean(exp.entropy, mask)),
            "clipfrac": upd["clipfrac"],
            "clipfrac_lower": upd["clipfrac_lower"],
            "ppo_kl": upd["ppo_kl"],
            "ratio_mean": upd["ratio_mean"],
            "grad_norm": upd["grad_norm"],
            "response_len_mean": resp_tokens / rb.size,
            "prompt_len_mean": float(rb.prompt_mask.sum()) / rb.size,
            # share of responses that hit data.max_response_length (verl's response_length/clip_ratio)
            "response_clip_ratio": float((mask.sum(dim=1) >= mask.shape[1]).float().mean()),
            "zero_std_group_frac": float(zero_std_group_fraction(raw, rb.uid)),
            "reward_errors": exp.reward_errors,
            "lr": lr_used,
            "time_step_s": t_end - t0,
            "time_gen_s": exp.t_gen - t0,
            "time_prep_s": t_prep - exp.t_gen,  # reward + log-probs + gather + advantages
            "time_reward_s": exp.t_scored - exp.t_gen,
            "time_logprob_s": t_prep - exp.t_scored,  # log-probs, gather and advantages
            "time_update_s": t_end - t_prep,
            # response tokens of all ranks per second of step time (the batch's generation + training rate)
            "response_tokens_per_s": resp_tokens / (t_end - t0),
            # verl's perf/throughput: prompt + response tokens / (step time x devices)
            "tokens_per_s_per_device": (resp_tokens + float(rb.prompt_mask.sum()))
            / ((t_end - t0) * self.comm.world_size),
            "mem_peak_gb": float(self.comm.all_reduce_max(peak)),
            "world_size": self.comm.world_size,
        }
        return metrics

    def update(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """ppo_epochs over shuffled mini-batches of the global batch; each rank takes its slice of
        every mini-batch and accumulates gradients over micro-batches."""
        a = self.cfg.actor
        g = torch.Generator().manual_seed(seed_for(self.cfg.trainer.seed, step, 2))
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
                micros = torch.arange(per_rank).split(a.micro_batch_size)
                for i, micro_idx in enumerate(micros):
                    micro = mine.select(micro_idx)
                    loss, m = self.micro_loss(micro, n_tok, n_seq)
                    self.strategy.gradient_sync(self.scorer, enabled=i == len(micros) - 1)
                    loss.backward()
                    self._accumulate(sums, m, sum(r for _, r in micro.rollout.host_lengths()))
                self.strategy.sync_grads(self.params)
                grad_norms.append(self._clip_and_step())
        n_updates = a.ppo_epochs * (batch.rollout.size // a.ppo_mini_batch_size)
        return self._reduce_update_metrics(sums, n_updates, grad_norms)

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
        # The one host read of an optimizer step: whether the norm is finite decides the step.
        norm = float(self.strategy.clip_grad_norm(self.params, self.cfg.actor.grad_clip))
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.log(f"step {self.step_done + 1}: gradient norm is {norm}, optimizer step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return norm

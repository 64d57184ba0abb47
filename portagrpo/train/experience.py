"""One step's experience: rollout, reward, log-probs, gather and advantages, as a typed Experience."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from portagrpo.algo.objective import shape_and_advantage
from portagrpo.batch import RolloutBatch, TrainBatch
from portagrpo.data.records import PromptRecord, tokenize_prompts
from portagrpo.metrics import pass_at_k
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.rewards.functions import score_responses
from portagrpo.rollout.engines import SamplingParams, rollout_groups


def seed_for(seed: int, step: int, salt: int) -> int:
    """One seed per (run seed, step, purpose): sampling, update order and validation never share a stream."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**63 - 1)


@dataclass
class Experience:
    """What the update and the metrics need from one step, on every rank the same global batch."""

    batch: TrainBatch
    raw_scores: torch.Tensor  # [B] the reward function's scores
    scores: torch.Tensor  # [B] after shaping
    correct: torch.Tensor  # [B] 0/1
    entropy: torch.Tensor | None  # [B, T] from the scoring pass; None on on-policy steps (taken from the update)
    reward_errors: float
    t_gen: float  # perf_counter when generation ended
    t_scored: float  # perf_counter when the rewards were in (log-probs and advantages follow)


def solved_of(correct: torch.Tensor) -> torch.Tensor:
    """Per prompt, pass@k from its k samples' 0/1 correctness [P, k] (the same estimator as eval)."""
    k = correct.shape[1]
    return torch.tensor([pass_at_k(k, int(c), k) for c in correct.sum(dim=1).tolist()], dtype=torch.float64)


class ExperienceMaker:
    """Experience methods of the Trainer (see loop.py)."""

    @property
    def on_policy(self) -> bool:
        """One update on the whole batch: the policy that sampled is the one being updated, so the
        old log-probs are the update's own (detached) and their separate pass is skipped, as in
        verl. A KL-in-reward needs old log-probs before the update, so it keeps the pass."""
        a = self.cfg.actor
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.cfg.rollout_batch_size
                and not self.cfg.algorithm.use_kl_in_reward)

    def make_experience(self, step: int) -> Experience:
        """Rollout, reward, log-probs and advantages for one step, over the global batch."""
        cfg = self.cfg
        records = self.local_records(self.loader.next_batch())
        width = self.prompt_width(records)
        self.backend.seed(seed_for(cfg.trainer.seed, step, 1 + 10 * self.comm.rank))
        params = self.sampling(cfg.rollout.temperature)
        uid_base = (step * cfg.data.train_batch_size) + self.comm.rank * len(records)
        rb = self.rollout(records, cfg.rollout.n, params, uid_base=uid_base, prompt_width=width)
        t_gen = time.perf_counter()
        scored = self.score(rb)
        t_scored = time.perf_counter()
        for failure in scored.failures[:3]:
            self.log(f"step {step}: reward failed on sample {failure.sample} (prompt id {failure.prompt_id}): "
                     f"{failure.message}")
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
        return Experience(TrainBatch(full_rb, adv, t["old"], t["ref"]), raw_scores=t["scores"], scores=scores,
                          correct=t["correct"], entropy=t["entropy"], reward_errors=float(t["errors"].sum()),
                          t_gen=t_gen, t_scored=t_scored)

    def experience_from_record(self, rec: dict[str, Any]) -> Experience:
        """Rebuild a recorded step's global batch on this backend: log-probs and advantages are
        recomputed here; rollout tokens and rewards are exactly the recorded ones."""
        d, t_start = self.device, time.perf_counter()
        lengths = torch.stack([rec["prompt_mask"].sum(1), rec["response_mask"].sum(1).round().long()], dim=1)
        rb = RolloutBatch(prompt_ids=rec["prompt_ids"].to(d), prompt_mask=rec["prompt_mask"].to(d),
                          responses=rec["responses"].to(d), response_mask=rec["response_mask"].to(d),
                          uid=rec["uid"].to(d), prompt_index=rec["prompt_index"].to(d), response_text=[],
                          ground_truth=[], data_source=[], extra_info=[],
                          lengths=[(int(p), int(r)) for p, r in lengths.cpu().tolist()])
        old_logp, entropy = self.logprobs(self.scorer, rb, entropy=True) if not self.on_policy else (None, None)
        ref_logp = self.logprobs(self.ref_scorer, rb, entropy=False)[0] if self.ref_scorer is not None else None
        raw = rec["scores"].to(d)
        scores, adv = self.advantages(rb, raw, old_logp, ref_logp)
        return Experience(TrainBatch(rb, adv, old_logp, ref_logp), raw_scores=raw, scores=scores,
                          correct=rec["correct"].to(d), entropy=entropy, reward_errors=0.0,
                          t_gen=t_start, t_scored=t_start)  # nothing generated or scored: both times are 0

    def local_records(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's share of the global prompt batch (whole prompts, so whole groups)."""
        per = len(records) // self.comm.world_size
        return records[self.comm.rank * per:(self.comm.rank + 1) * per]

    def sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(self.cfg.data.max_response_length, temperature, r.top_p, r.top_k, r.min_p,
                              r.repetition_penalty)

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int,
                prompt_width: int | None = None) -> RolloutBatch:
        # Sampling with the training model itself (not an engine holding its own weights): a sharded
        # policy is gathered once for the whole rollout.
        gather = nullcontext() if self.engine.holds_weights else self.strategy.generation(self.scorer)
        with gather, self.backend.region("rollout"):
            return rollout_groups(self.engine, self.tokenizer, records, n, params, self.device, uid_base=uid_base,
                                  prompt_width=prompt_width)

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
        # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
        with eval_mode(scorer), self.backend.region("logprobs"):
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
            # the step's one read of the global lengths, so every rank's update plans on the host
            lengths=[(p, r) for p, r in g(torch.tensor(rb.host_lengths(), device=self.device)).tolist()],
        )
        return full, {k: (None if v is None else g(v)) for k, v in tensors.items()}

    def advantages(
        self, batch: RolloutBatch, scores: torch.Tensor, old_logp, ref_logp
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward shaping then the group advantage (algo.objective). Returns (scores', advantages [B, T])."""
        return shape_and_advantage(scores, batch.uid, batch.response_mask, self.shaping, old_logp=old_logp,
                                   ref_logp=ref_logp)

    def validate(self) -> dict[str, float]:
        """Held-out mean reward and accuracy; the split is shared across ranks and reduced."""
        if not self.val_records:
            return {}
        cfg = self.cfg
        params = self.sampling(cfg.rollout.val_temperature)
        state = torch.get_rng_state()  # validation must not shift the training RNG stream
        self.backend.seed(seed_for(cfg.trainer.seed, self.step_done, 3 + 10 * self.comm.rank))
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
                                   (w * solved_of(correct)).sum()])
        torch.set_rng_state(state)
        score_sum, correct_sum, count, solved = self.comm.sum_on_host(totals).tolist()
        out = {"val/reward_mean": score_sum / count, "val/acc": correct_sum / count}
        if k > 1:
            out[f"val/pass@{k}"] = solved / (count / k)
        return out

"""One rank's sampling and scoring, the pieces every batch source is made of (train/sources/): this rank's share
of a prompt batch, its sampling stream, the rollout, the rewards, the old and reference log-probs, and the
gather into the global batch. Held-out validation samples with the same pieces."""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import torch

from portagrpo.algo.advantages import overlong_penalty
from portagrpo.batch import RolloutBatch, micro_batches
from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.metrics import ValMetrics
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.model.vision import check_vision_run, vision_prompts, with_rows
from portagrpo.model.vision_gather import gather_images
from portagrpo.rewards.functions import ScoredBatch, score_responses
from portagrpo.rollout.engines import GroupPrompts, SamplingParams, rollout_batch, rollout_groups
from portagrpo.train.build import Data, Models, Runtime
from portagrpo.train.experience import ExperienceSettings, Scored, ScoredRollout, seed_for, solved_of
from portagrpo.train.record import StepRecord

ROUND_SPAN = 1000  # sampling rounds a step may take (DAPO) before two steps' group ids could meet


def sampling_seed(seed: int, step: int, rank: int, round_: int = 0) -> int:
    """The sampling stream of `rank` in sampling round `round_` of `step` (round 0: the step's one rollout)."""
    return seed_for(seed, step, 1 + 10 * rank + 100_003 * round_)


def uid_base(step: int, round_: int, n_prompts: int, rank: int, n_local: int) -> int:
    """The first group id of `rank`'s share of a round's `n_prompts` prompts: unique over steps, rounds and ranks."""
    return (step * ROUND_SPAN + round_) * n_prompts + rank * n_local


class Sampling:
    """This rank's part in turning a global prompt batch into a scored global batch."""

    def __init__(self, settings: ExperienceSettings, runtime: Runtime, data: Data, models: Models, engine,
                 log: Callable[[str], None]) -> None:
        self.settings, self.runtime, self.log = settings, runtime, log
        self.tokenizer, self.reward, self.reward_pool = data.tokenizer, data.reward, data.reward_pool
        self.scorer, self.ref_scorer, self.strategy = models.scorer, models.ref_scorer, models.strategy
        self.engine = engine
        self.processor = data.processor
        if self.processor is not None:
            check_vision_run(settings, engine)

    # ---- one round: this rank's share, sampled with its stream
    def local_records(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's share of the global prompt batch (whole prompts, so whole groups)."""
        comm = self.runtime.comm
        per = len(records) // comm.world_size
        return records[comm.rank * per:(comm.rank + 1) * per]

    def prompt_width(self, records: list[PromptRecord]) -> int:
        """One left-padded prompt width for all ranks, so rollouts can be gathered."""
        return self.widest(max(len(x) for x in tokenize_prompts(self.tokenizer, records)))

    def widest(self, local: int) -> int:
        """The largest of every rank's `local` width."""
        return int(self.runtime.comm.all_reduce_max(torch.tensor(local, device=self.runtime.device)))

    def round_ids(self, step: int, round_: int, prompts: list[PromptRecord]) -> tuple[list[PromptRecord], int]:
        """This rank's records of a round of `step` and their first group id."""
        comm, records = self.runtime.comm, self.local_records(prompts)
        return records, uid_base(step, round_, len(prompts), comm.rank, len(records))

    def stream_seed(self, step: int, round_: int = 0) -> int:
        """The seed of this rank's sampling stream in a round of `step` (a sampler process gets it with the request)."""
        return sampling_seed(self.settings.seed, step, self.runtime.comm.rank, round_)

    def sample(self, step: int, prompts: list[PromptRecord], round_: int = 0,
               width: int | None = None) -> RolloutBatch:
        """This rank's rollout of its share of `prompts` (`width`: the prompt width, else the widest over ranks)."""
        records, first_uid = self.round_ids(step, round_, prompts)
        width = self.prompt_width(records) if width is None else width
        self.runtime.backend.seed(self.stream_seed(step, round_))
        return self.rollout(records, self.settings.n, self.settings.sampling, uid_base=first_uid, prompt_width=width)

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int,
                prompt_width: int | None = None) -> RolloutBatch:
        # Sampling with the training model itself (not an engine holding its own weights): a sharded
        # policy is gathered once for the whole rollout.
        gather = nullcontext() if self.engine.holds_weights else self.strategy.generation(self.scorer)
        with self.runtime.phase("rollout"), gather:  # the gather is a part of the rollout's peak
            if self.processor is not None:
                return vision_rollout(self.engine, self.processor, records, n, params, self.runtime.device,
                                      uid_base=uid_base, prompt_width=prompt_width, widen=self.widest)
            return rollout_groups(self.engine, self.tokenizer, records, n, params, self.runtime.device,
                                  uid_base=uid_base, prompt_width=prompt_width)

    # ---- rewards and log-probs
    def score(self, batch: RolloutBatch) -> ScoredBatch:
        return score_responses(
            self.reward, batch.response_text, batch.ground_truth, batch.data_source, batch.prompt_index.tolist(),
            batch.extra_info, max_error_frac=self.settings.max_error_frac, pool=self.reward_pool,
        )

    def local_scored(self, step: int, rb: RolloutBatch, scored: ScoredBatch, old_logp: torch.Tensor | None = None,
                     ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> Scored:
        """This rank's rewards (with any overlong penalty) and log-probs as tensors; the first reward
        failures are logged."""
        for failure in scored.failures[:3]:
            self.log(f"step {step}: reward failed on sample {failure.sample} (prompt id {failure.prompt_id}): "
                     f"{failure.message}")
        device = self.runtime.device
        return Scored(self.shaped_scores(rb, scored.scores),
                      torch.tensor(scored.correct, dtype=torch.float32, device=device),
                      torch.tensor([float(len(scored.failures))], device=device), old_logp, ref_logp, entropy)

    def shaped_scores(self, rb: RolloutBatch, scores: list[float]) -> torch.Tensor:
        """The reward function's scores, with DAPO's overlong penalty when it is on."""
        out = torch.tensor(scores, dtype=torch.float32, device=self.runtime.device)
        if self.settings.overlong is not None:
            max_len, buffer, factor = self.settings.overlong
            lengths = torch.tensor([r for _, r in rb.host_lengths()], device=out.device)
            out = out + overlong_penalty(lengths, max_len, buffer, factor)
        return out

    def old_and_ref(self, rb: RolloutBatch) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The old log-probs (when a scoring pass runs), the reference log-probs (with a reference model), and
        the entropy of the scoring pass, over `rb` (both passes in one micro-batch plan)."""
        if not self.settings.scoring_pass and self.ref_scorer is None:
            return None, None, None
        plan = self.micro_plan(rb)
        old, entropy = (self.logprobs(self.scorer, rb, entropy=True, plan=plan) if self.settings.scoring_pass
                        else (None, None))
        ref = self.logprobs(self.ref_scorer, rb, entropy=False, plan=plan)[0] if self.ref_scorer is not None else None
        return old, ref, entropy

    def micro_plan(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """This rank's scoring micro-batches of `batch`. With a token budget on several ranks, as many as the most
        any rank plans (verl all-reduces the count too), so sharded forwards stay in lockstep."""
        s, comm = self.settings, self.runtime.comm
        plan = micro_batches(batch, s.micro_batch_size, s.token_budget)
        if s.token_budget is None or comm.world_size == 1:
            return plan
        # host read: one per step's scoring, with a token budget on several ranks
        count = int(comm.all_reduce_max(torch.tensor(len(plan), device=self.runtime.device)))
        return micro_batches(batch, s.micro_batch_size, s.token_budget, count)

    @torch.no_grad()
    def logprobs(self, scorer, batch: RolloutBatch, *, entropy: bool,
                 plan: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, T] (and entropy) of `scorer`'s model over the batch, in micro-batches (`plan`, else
        `micro_plan`'s)."""
        s = self.settings
        logps, ents, order = [], [], []
        # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
        with eval_mode(scorer), self.runtime.phase("logprobs"):
            for rows in self.micro_plan(batch) if plan is None else plan:
                part = batch.select(rows)
                stats = response_stats(scorer, part, temperature=s.temperature, compute_entropy=entropy,
                                       autocast=self.runtime.autocast)
                logps.append(stats.logp)
                order += rows.tolist()
                if entropy:
                    ents.append(stats.entropy)
        logp, ent = torch.cat(logps), (torch.cat(ents) if entropy else None)
        if order != sorted(order):  # token-budget groups are not in row order
            back = _inverse(order, batch.responses.device)
            logp, ent = logp.index_select(0, back), (None if ent is None else ent.index_select(0, back))
        return logp, ent

    # ---- the global batch
    def gather(self, rb: RolloutBatch, local: Scored) -> tuple[RolloutBatch, Scored]:
        """The global batch, identical on every rank, in rank order (one process: unchanged)."""
        comm = self.runtime.comm
        if comm.world_size == 1:
            return rb, local
        g = comm.all_gather_cat
        full = RolloutBatch(
            prompt_ids=g(rb.prompt_ids), prompt_mask=g(rb.prompt_mask), responses=g(rb.responses),
            response_mask=g(rb.response_mask), uid=g(rb.uid), prompt_index=g(rb.prompt_index),
            response_text=[], ground_truth=[], data_source=[], extra_info=[],
            # the step's one read of the global lengths, so every rank's update plans on the host
            lengths=[(p, r) for p, r in g(torch.tensor(rb.host_lengths(), device=self.runtime.device)).tolist()],
            rollout_logp=None if rb.rollout_logp is None else g(rb.rollout_logp),
            model_mask=None if rb.model_mask is None else g(rb.model_mask),
            routes=None if rb.routes is None else g(rb.routes.long()).to(rb.routes.dtype),  # int64 on the wire
            # a vision-language policy's images, gathered so each row's pixels follow it
            images=None if self.processor is None else gather_images(comm, rb.images, rb.size, self.runtime.device),
        )
        return full, Scored(*(None if v is None else g(v) for v in local.tensors()))

    def scored_rollout(self, step: int, rb: RolloutBatch, t_gen: float, staleness: int | None = None) -> ScoredRollout:
        """This rank's rollout `rb` (generation ended at `t_gen`) scored, with its log-probs, as the global batch."""
        scored = self.score(rb)
        t_scored = time.perf_counter()
        old, ref, entropy = self.old_and_ref(rb)
        full, g = self.gather(rb, self.local_scored(step, rb, scored, old, ref, entropy))
        return ScoredRollout(full, g.scores, g.correct, float(g.errors.sum()), g.old_logp, g.ref_logp, g.entropy,
                             t_gen=t_gen, t_scored=t_scored, staleness=staleness)

    def sample_and_score(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        """One plain rollout of the global prompt batch `prompts` for `step`, scored and gathered."""
        rb = self.sample(step, prompts)
        return self.scored_rollout(step, rb, time.perf_counter())

    def from_record(self, record: StepRecord) -> ScoredRollout:
        """A recorded step's global batch on this backend: rollout tokens and rewards exactly the recorded ones,
        log-probs computed here."""
        d, t_start = self.runtime.device, time.perf_counter()
        rb = record.rollout_batch(d)
        old, ref, entropy = self.old_and_ref(rb)
        # nothing generated or scored here: both times are the start
        return ScoredRollout(rb, record.scores.to(d), record.correct.to(d), 0.0, old, ref, entropy,
                             t_gen=t_start, t_scored=t_start)

    # ---- held-out validation
    def validate(self, step: int, val_records: list[PromptRecord]) -> ValMetrics | None:
        """Held-out mean reward and accuracy after `step`; the split is shared across ranks and reduced. None
        without a validation split."""
        if not val_records:
            return None
        s, comm = self.settings, self.runtime.comm
        state = torch.get_rng_state()  # validation must not shift the training RNG stream
        self.runtime.backend.seed(seed_for(s.seed, step, 3 + 10 * comm.rank))
        world, rank = comm.world_size, comm.rank
        per = -(-len(val_records) // world)
        mine = val_records[rank * per:(rank + 1) * per]
        weights = [1.0] * len(mine) + [0.0] * (per - len(mine))
        mine = mine + [val_records[0]] * (per - len(mine))  # equal work per rank; padding weighs 0
        bs, k = max(s.val_batch_size // world, 1), s.val_n
        totals = torch.zeros(4, dtype=torch.float64)  # score sum, correct sum, samples, prompts solved (pass@k)
        for start in range(0, per, bs):
            records = mine[start:start + bs]
            rb = self.rollout(records, k, s.val_sampling, uid_base=0, prompt_width=self.prompt_width(records))
            scored = self.score(rb)
            w = torch.tensor(weights[start:start + bs], dtype=torch.float64)
            scores = torch.tensor(scored.scores, dtype=torch.float64).view(-1, k)
            correct = torch.tensor(scored.correct, dtype=torch.float64).view(-1, k)
            totals += torch.stack([(w[:, None] * scores).sum(), (w[:, None] * correct).sum(), w.sum() * k,
                                   (w * solved_of(correct)).sum()])
        torch.set_rng_state(state)
        score_sum, correct_sum, count, solved = comm.sum_on_host(totals).tolist()
        return ValMetrics(reward_mean=score_sum / count, acc=correct_sum / count, k=k,
                          pass_at_k=solved / (count / k) if k > 1 else None)


def _inverse(order: list[int], device) -> torch.Tensor:
    """Positions that put rows gathered in `order` back in row order (host indices, copied without waiting)."""
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return torch.tensor(back, dtype=torch.long).to(device, non_blocking=True)


def vision_rollout(engine, processor, records: list, n: int, params, device, *, uid_base: int = 0,
                   prompt_width: int | None = None, widen: Callable[[int], int] | None = None):
    """As `rollout_groups`, for vision-language prompts: each record processed once (its image tokens expanded,
    its images to patches), its prompt n times (a group), left-padded, generated with the images, decoded. The
    batch keeps the images once per prompt (`RolloutBatch.images`). `widen` makes the padded width every rank's
    widest (image tokens are known only now, and ranks' rollouts are gathered)."""
    ids, images = vision_prompts(processor, records, device)
    rows = [x for x in ids for _ in range(n)]
    width = max(prompt_width or 0, max(len(x) for x in rows))
    prompt_ids, prompt_mask = left_pad(rows, engine.pad_id, width=width if widen is None else widen(width))
    group = GroupPrompts(records, n, rows, prompt_ids.to(device), prompt_mask.to(device), uid_base)
    images = with_rows(images, n)
    batch = rollout_batch(processor.tokenizer, group, engine.generate(group.prompt_ids, group.prompt_mask, params,
                                                                      images=images))
    batch.images = images
    return batch

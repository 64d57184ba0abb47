"""The one rollout pipeline: how a step's prompts become its scored global batch, whoever generates and whenever.

Every round runs in one fixed order:

    share     this rank's contiguous share of the round's global prompts, its first group id     `request`
    prompts   the generator's prompt tokens (and images) for them                                generator.prompts
    width     one left-padded prompt width over the ranks (a collective)                          `request`
    seed      this rank's sampling stream for (step, round)                                       `generate`
    generate  the generator's rows, with an engine                                                generator.generate
    score     the rewards of this rank's rows (DAPO's overlong penalty on them)                   `score`
    gather    every rank's rows and rewards, in rank order, the same on every rank                `gather`
    keep      the group filter's rows (train/filters.py: all, acc, score)                         `keep_rows`

and once the kept groups fill the step's batch (one round with the `all` filter; DAPO's filters sample more rounds
of new prompts until they do), the old and reference log-probs on each rank's share of it, gathered back.

Two plug points: the generator (rollout/generators/: how a round's rows are made) and the group filter. Where and
when `generate` runs is the schedule's (train/schedule.py): `Pipeline.generate` here, in the step, with the
trainer's engine; or a sampler process that runs the same generator one step ahead (rollout.mode=one_step_off),
handed in as `produce`. Held-out validation runs the same share, prompts, width and generate.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch

from portagrpo.algo.advantages import overlong_penalty
from portagrpo.batch import RolloutBatch
from portagrpo.config import Config
from portagrpo.data.records import PromptRecord
from portagrpo.errors import UserError
from portagrpo.metrics import ValMetrics
from portagrpo.model.vision_gather import gather_images
from portagrpo.rewards.functions import ScoredBatch, score_responses
from portagrpo.rollout.engines import RolloutEngine
from portagrpo.rollout.generators import Generated, Generator, RoundPrompts
from portagrpo.rollout.settings import SamplingParams
from portagrpo.train.build import Data, Models, Runtime
from portagrpo.train.experience import Scored, ScoredRollout, seed_for, solved_of
from portagrpo.train.filters import FILTERS
from portagrpo.train.logprobs import LogProbs, ScoringSettings
from portagrpo.train.record import StepRecord

ROUND_SPAN = 1000  # sampling rounds a step may take (DAPO) before two steps' group ids could meet
NOTICE_EVERY = 10  # sampling rounds between two notices while a step's batch is still not full


def sampling_seed(seed: int, step: int, rank: int, round_: int = 0) -> int:
    """The sampling stream of `rank` in sampling round `round_` of `step` (round 0: the step's one rollout)."""
    return seed_for(seed, step, 1 + 10 * rank + 100_003 * round_)


def uid_base(step: int, round_: int, n_prompts: int, rank: int, n_local: int) -> int:
    """The first group id of `rank`'s share of a round's `n_prompts` prompts: unique over steps, rounds and ranks."""
    return (step * ROUND_SPAN + round_) * n_prompts + rank * n_local


def gather_as_bytes(gather: Callable[[torch.Tensor], torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """`gather` (every rank's rows, concatenated along dim 0) of an integer tensor: int64 as it is, a narrower one as
    its bytes (uint8, which every vendor's collective takes; NCCL has no int16), so a MoE's int16 routes cross the wire
    and land at 2 bytes a cell rather than 8 (the global batch's routes are held on every rank: widening them to int64
    for the gather took 4x that at the step's peak). An all-gather only copies, so the bytes come back exact."""
    if local.dtype == torch.int64 or local.dim() == 0:
        return gather(local.long()).to(local.dtype)
    return gather(local.contiguous().view(torch.uint8)).view(local.dtype)


def round_notice(step: int, rounds: int, kept: int, dropped: int, groups: int, metric: str, limit: int) -> str:
    """The line that says a step is still sampling (a reward without spread can keep it going for ever)."""
    key = f"algorithm.filter_groups.max_num_gen_batches={limit}"
    bound = (f"{key} sets no limit, so this goes on until {groups} groups differ (set it to stop after that many "
             f"rounds)" if not limit else f"{key} stops the step after {limit} rounds")
    return (f"step {step}: still sampling after gen_rounds={rounds}: {kept} of {groups} prompt groups kept, "
            f"{dropped} dropped (the same {metric} for every response); {bound}.")


@dataclass(frozen=True)
class RoundRequest:
    """One round on this rank, ready to generate wherever the schedule generates it."""

    prompts: RoundPrompts
    width: int  # the left-padded prompt width, the same on every rank
    seed: int  # this rank's sampling stream for the round


Produce = Callable[[RoundRequest], Generated]  # generates a round: in the step, or in a sampler process


@dataclass
class Kept:
    """The rounds' kept rows so far (gathered: the same on every rank)."""

    rollouts: list[RolloutBatch]
    scores: list[torch.Tensor]
    correct: list[torch.Tensor]
    rows: int = 0
    errors: float = 0.0
    dropped: int = 0  # groups
    counts: dict[str, float] | None = None  # the generator's, summed over rounds (this rank's)

    def add(self, full: RolloutBatch, g: Scored, rows: torch.Tensor, made: Generated, n: int) -> None:
        """A gathered round (`full`, its rewards `g`), of which the filter kept `rows` (host indices)."""
        self.errors += float(g.errors.sum())
        self.dropped += (full.size - rows.numel()) // n
        if made.counts:
            self.counts = {k: (self.counts or {}).get(k, 0.0) + v for k, v in made.counts.items()}
        if rows.numel():
            on = rows.to(g.scores.device)
            self.rollouts.append(full.select(rows))
            self.scores.append(g.scores[on])
            self.correct.append(g.correct[on])
            self.rows += rows.numel()


@dataclass(frozen=True)
class RolloutSettings:
    """What the pipeline reads: how many responses a prompt gets and how they are sampled (training and validation),
    how many reward errors a step tolerates, DAPO's overlong penalty and group filter (whose rounds may take several,
    their prompts padded to at least data.max_prompt_length so rounds of text prompts share one width)."""

    seed: int
    n: int  # responses per prompt
    sampling: SamplingParams
    val_sampling: SamplingParams
    val_n: int
    val_batch_size: int  # prompts per validation rollout, over all ranks
    max_error_frac: float
    overlong: tuple[int, int, float] | None = None  # DAPO: (max response length, buffer, penalty factor)
    group_filter: str = "all"  # the groups a round keeps (train/filters.py): all, or DAPO's acc or score
    max_rounds: int = 0  # sampling rounds per step at most (0: no limit)
    min_prompt_width: int = 0  # every round's prompts padded to at least this width

    @classmethod
    def from_config(cls, cfg: Config) -> "RolloutSettings":
        r, ob, fg = cfg.rollout, cfg.reward.overlong_buffer, cfg.algorithm.filter_groups

        def sampling(temperature: float) -> SamplingParams:
            return SamplingParams(cfg.data.max_response_length, temperature, r.top_p, r.top_k, r.min_p,
                                  r.repetition_penalty)

        return cls(seed=cfg.trainer.seed, n=r.n, sampling=sampling(r.temperature),
                   val_sampling=sampling(r.val_temperature), val_n=r.val_n, val_batch_size=cfg.data.train_batch_size,
                   max_error_frac=cfg.reward.max_error_frac,
                   overlong=(cfg.data.max_response_length, ob.len, ob.penalty_factor) if ob.enable else None,
                   group_filter=fg.metric if fg.enable else "all", max_rounds=fg.max_num_gen_batches,
                   min_prompt_width=cfg.data.max_prompt_length if fg.enable else 0)


class Pipeline:
    """This rank's part in turning a global prompt batch into the step's scored global batch."""

    def __init__(self, settings: RolloutSettings, scoring: ScoringSettings, runtime: Runtime, data: Data,
                 models: Models, engine: RolloutEngine, generator: Generator, log: Callable[[str], None]) -> None:
        self.settings, self.runtime, self.log = settings, runtime, log
        self.tokenizer, self.reward, self.reward_pool = data.tokenizer, data.reward, data.reward_pool
        self.loader = data.loader
        self.vision = data.processor is not None  # rows carry images, which the gather moves with them
        self.scorer, self.strategy = models.scorer, models.strategy
        self.engine, self.generator = engine, generator
        self.logprobs = LogProbs(scoring, runtime, models)
        self.keep_rows = FILTERS.get(settings.group_filter, field="algorithm.filter_groups.metric")
        generator.check(engine)

    # ---- share, prompts, width, seed, generate
    def local_records(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's share of the global prompt batch (whole prompts, so whole groups)."""
        comm = self.runtime.comm
        per = len(records) // comm.world_size
        return records[comm.rank * per:(comm.rank + 1) * per]

    def widest(self, local: int) -> int:
        """The largest of every rank's `local` width."""
        return int(self.runtime.comm.all_reduce_max(torch.tensor(local, device=self.runtime.device)))

    def request(self, step: int, round_: int, prompts: list[PromptRecord]) -> RoundRequest:
        """This rank's share of a round of `step` (global `prompts`), as the generator's prompts, with one width
        over the ranks (a collective: every rank asks in the same round) and its sampling seed."""
        comm, records = self.runtime.comm, self.local_records(prompts)
        first = uid_base(step, round_, len(prompts), comm.rank, len(records))
        ready = self.generator.prompts(records, first, self.runtime.device)
        width = self.widest(max(self.settings.min_prompt_width, ready.widest))
        return RoundRequest(ready, width, sampling_seed(self.settings.seed, step, comm.rank, round_))

    def generate(self, request: RoundRequest) -> Generated:
        """A round generated here, in the step, with the trainer's engine: its stream seeded first."""
        self.runtime.backend.seed(request.seed)
        return self.here(request, self.settings.n, self.settings.sampling)

    def here(self, request: RoundRequest, n: int, params: SamplingParams) -> Generated:
        # Sampling with the training model itself (not an engine holding its own weights): a sharded
        # policy is gathered once for the whole rollout.
        gather = nullcontext() if self.engine.holds_weights else self.strategy.generation(self.scorer)
        with self.runtime.phase("rollout"), gather:  # the gather is a part of the rollout's peak
            return self.generator.generate(self.engine, request.prompts, n, params, request.width,
                                           self.runtime.device)

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int = 0) -> RolloutBatch:
        """This rank's rows for `records` (n each, no seeding: the stream as it is), padded to the widest over ranks:
        what validation samples, and a test's direct rollout."""
        ready = self.generator.prompts(records, uid_base, self.runtime.device)
        return self.here(RoundRequest(ready, self.widest(ready.widest), 0), n, params).rollout

    # ---- score, gather
    def score(self, batch: RolloutBatch) -> ScoredBatch:
        return score_responses(
            self.reward, batch.response_text, batch.ground_truth, batch.data_source, batch.prompt_index.tolist(),
            batch.extra_info, max_error_frac=self.settings.max_error_frac, pool=self.reward_pool,
        )

    def local_scored(self, step: int, rb: RolloutBatch, scored: ScoredBatch) -> Scored:
        """This rank's rewards (with any overlong penalty) as tensors; the first reward failures are logged."""
        for failure in scored.failures[:3]:
            self.log(f"step {step}: reward failed on sample {failure.sample} (prompt id {failure.prompt_id}): "
                     f"{failure.message}")
        device = self.runtime.device
        return Scored(self.shaped_scores(rb, scored.scores),
                      torch.tensor(scored.correct, dtype=torch.float32, device=device),
                      torch.tensor([float(len(scored.failures))], device=device), None, None, None)

    def shaped_scores(self, rb: RolloutBatch, scores: list[float]) -> torch.Tensor:
        """The reward function's scores, with DAPO's overlong penalty when it is on."""
        out = torch.tensor(scores, dtype=torch.float32, device=self.runtime.device)
        if self.settings.overlong is not None:
            max_len, buffer, factor = self.settings.overlong
            lengths = torch.tensor([r for _, r in rb.host_lengths()], device=out.device)
            out = out + overlong_penalty(lengths, max_len, buffer, factor)
        return out

    def gather(self, rb: RolloutBatch, local: Scored) -> tuple[RolloutBatch, Scored]:
        """The global batch, identical on every rank, in rank order (one process: unchanged)."""
        comm = self.runtime.comm
        if comm.world_size == 1:
            return rb, local
        g = comm.all_gather_cat
        # every tensor field through the batch's one walk (`map`), integers narrower than int64 as their bytes (a MoE's
        # int16 routes: 2 bytes a cell, not 8); what only the gather adds: the per-sample text stays with its rank,
        # the lengths come over in the step's one read of them (so every rank's update plans on the host), and a
        # vision-language policy's images are gathered so each row's pixels follow it
        lean = replace(rb, response_text=[], ground_truth=[], data_source=[], extra_info=[], lengths=[], images=None)
        full = replace(lean.map(lambda t: g(t) if t.is_floating_point() else gather_as_bytes(g, t)),
                       lengths=[(p, r) for p, r in g(torch.tensor(rb.host_lengths(),
                                                                  device=self.runtime.device)).tolist()],
                       images=gather_images(comm, rb.images, rb.size, self.runtime.device) if self.vision else None)
        return full, Scored(*(None if v is None else g(v) for v in local.tensors()))

    # ---- the step's rounds
    def sample_and_score(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        """Step `step`'s batch from `prompts`, every round generated here (the in-step schedule's)."""
        return self.batch(step, prompts, self.generate)

    def batch(self, step: int, prompts: list[PromptRecord], produce: Produce, first: Generated | None = None,
              staleness: int | None = None) -> ScoredRollout:
        """Step `step`'s scored global batch from its global `prompts`: rounds generated by `produce` (round 0 is
        `first` when it was generated ahead), scored, gathered and filtered until the kept groups fill the batch,
        then log-probs on each rank's share."""
        s = self.settings
        target = len(prompts) * s.n  # responses
        kept = Kept([], [], [])
        round_ = 0
        while kept.rows < target:
            self._check_rounds(step, round_, kept, len(prompts))
            made = first if round_ == 0 and first is not None else produce(
                self.request(step, round_, prompts if round_ == 0 else self.loader.next_batch()))
            t_gen = time.perf_counter()
            self._keep(step, made, kept)
            t_scored = time.perf_counter()
            round_ += 1
        return self._scored(kept, target, round_, t_gen, t_scored, staleness)

    def _check_rounds(self, step: int, round_: int, kept: Kept, groups: int) -> None:
        s, comm = self.settings, self.runtime.comm
        if round_ and round_ % NOTICE_EVERY == 0 and comm.rank == 0 and round_ != s.max_rounds:
            self.log(round_notice(step, round_, kept.rows // s.n, kept.dropped, groups, s.group_filter, s.max_rounds))
        if s.max_rounds and round_ >= s.max_rounds:
            raise UserError(f"step {step}: after {round_} sampling rounds (algorithm.filter_groups."
                            f"max_num_gen_batches={s.max_rounds}) only {kept.rows // s.n} of {groups} prompt "
                            f"groups had different {s.group_filter} values; raise max_num_gen_batches (0: no "
                            f"limit), or use a task where responses differ.")

    def _keep(self, step: int, made: Generated, kept: Kept) -> None:
        """Score a round's rows, gather them and keep the filter's groups."""
        rb = made.rollout
        full, g = self.gather(rb, self.local_scored(step, rb, self.score(rb)))
        rows = torch.nonzero(self.keep_rows(g.scores, g.correct, full.uid)).flatten().cpu()  # alike on every rank
        kept.add(full, g, rows, made, self.settings.n)

    def _scored(self, kept: Kept, target: int, rounds: int, t_gen: float, t_scored: float,
                staleness: int | None) -> ScoredRollout:
        """The first `target` kept rows (whole groups), with log-probs: each rank scores its contiguous share, and
        the shares are gathered back in rank order."""
        comm = self.runtime.comm
        batch = RolloutBatch.cat(kept.rollouts, self.engine.pad_id).select(torch.arange(target))
        scores, correct = torch.cat(kept.scores)[:target], torch.cat(kept.correct)[:target]
        per = target // comm.world_size
        mine = batch.select(torch.arange(comm.rank * per, (comm.rank + 1) * per))
        passes = self.logprobs.old_and_ref(mine)
        old, ref, entropy, routes = (None if t is None else self.gather_tensor(t)
                                     for t in (passes.old, passes.ref, passes.entropy, passes.routes))
        if routes is not None:  # actor.router_replay=R2: the scoring pass's routes, which the update replays
            batch = replace(batch, routes=routes)
        return ScoredRollout(batch, scores, correct, kept.errors, old, ref, entropy, t_gen=t_gen, t_scored=t_scored,
                             gen_rounds=rounds, staleness=staleness, rollout_metrics=self.metrics(kept.counts),
                             route_counts=passes.route_counts, old_routes=routes is not None)

    def gather_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of `local`, in rank order (narrow integers travel as their bytes: `gather_as_bytes`)."""
        comm = self.runtime.comm
        if comm.world_size == 1:
            return local
        if local.is_floating_point():
            return comm.all_gather_cat(local)
        return gather_as_bytes(comm.all_gather_cat, local)

    def metrics(self, counts: dict[str, float] | None) -> dict[str, float] | None:
        """The generator's metrics from its counts over every rank (one host sum); None when it counts nothing."""
        if not counts:
            return None
        local = torch.tensor(list(counts.values()), dtype=torch.float64, device=self.runtime.device)
        return self.generator.metrics(dict(zip(counts, self.runtime.comm.sum_on_host(local).tolist())))

    # ---- a recorded step, held-out validation
    def from_record(self, record: StepRecord) -> ScoredRollout:
        """A recorded step's global batch on this backend: rollout tokens and rewards exactly the recorded ones,
        log-probs computed here."""
        d, t_start = self.runtime.device, time.perf_counter()
        rb = record.rollout_batch(d)
        passes = self.logprobs.old_and_ref(rb)
        old, ref, entropy, routes = passes.old, passes.ref, passes.entropy, passes.routes
        rb = rb if routes is None else replace(rb, routes=routes)
        # nothing generated or scored here: both times are the start
        return ScoredRollout(rb, record.scores.to(d), record.correct.to(d), 0.0, old, ref, entropy,
                             t_gen=t_start, t_scored=t_start, route_counts=passes.route_counts,
                             old_routes=routes is not None)

    def validate(self, step: int, val_records: list[PromptRecord]) -> ValMetrics | None:
        """Held-out mean reward and accuracy after `step`, sampled by the run's generator in the trainer; the split
        is shared across ranks and reduced. None without a validation split."""
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
            scored = self.score(self.rollout(mine[start:start + bs], k, s.val_sampling))
            w = torch.tensor(weights[start:start + bs], dtype=torch.float64)
            scores = torch.tensor(scored.scores, dtype=torch.float64).view(-1, k)
            correct = torch.tensor(scored.correct, dtype=torch.float64).view(-1, k)
            totals += torch.stack([(w[:, None] * scores).sum(), (w[:, None] * correct).sum(), w.sum() * k,
                                   (w * solved_of(correct)).sum()])
        torch.set_rng_state(state)
        score_sum, correct_sum, count, solved = comm.sum_on_host(totals).tolist()
        return ValMetrics(reward_mean=score_sum / count, acc=correct_sum / count, k=k,
                          pass_at_k=solved / (count / k) if k > 1 else None)

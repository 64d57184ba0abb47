"""Group filters: which groups of a sampled round the step keeps, by name (`all`, or DAPO's
`algorithm.filter_groups.metric`: `acc` or `score`). A filter is a function of the round's gathered rewards,
correctness and group ids that answers, per row, whether it is kept (whole groups, the same on every rank). With a
filter that drops groups, the pipeline samples more rounds until the step holds `data.train_batch_size` groups
(train/pipeline.py). A new filter is one function registered here."""
from __future__ import annotations

from typing import Callable

import torch

from portagrpo.algo.advantages import groups_with_spread
from portagrpo.registry import Registry

GroupFilter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (scores, correct, uid) -> [B] bool
FILTERS: Registry[GroupFilter] = Registry("group filter")


@FILTERS.register("all")
def keep_all(scores: torch.Tensor, correct: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """Every group (a plain GRPO step: one round)."""
    return torch.ones_like(uid, dtype=torch.bool)


@FILTERS.register("acc")
def accuracy_spread(scores: torch.Tensor, correct: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling on correctness: groups whose responses are not all right or all wrong."""
    return groups_with_spread(correct, uid)


@FILTERS.register("score", "seq_reward", "seq_final_reward")
def score_spread(scores: torch.Tensor, correct: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling on the reward (with any overlong penalty): groups whose rewards differ. verl's
    seq_reward and seq_final_reward name the same per-response reward here."""
    return groups_with_spread(scores, uid)

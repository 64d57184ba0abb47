"""Micro-batch plans that several ranks agree on (actor.use_dynamic_bsz): split up to another rank's count within the
budget, and mini-batch shares balanced by tokens (verl's balance_batch)."""
import random

import pytest
import torch

from portagrpo.batch import RolloutBatch, balanced_shares, micro_batches, split_groups, token_budget_groups


def _rollout(lengths: list[tuple[int, int]]) -> RolloutBatch:
    b, p, t = len(lengths), max(x for x, _ in lengths), max(r for _, r in lengths)
    return RolloutBatch(prompt_ids=torch.zeros(b, p, dtype=torch.long), prompt_mask=torch.ones(b, p, dtype=torch.long),
                        responses=torch.zeros(b, t, dtype=torch.long), response_mask=torch.ones(b, t),
                        uid=torch.arange(b), prompt_index=torch.arange(b), response_text=[], ground_truth=[],
                        data_source=[], extra_info=[], lengths=list(lengths))


def test_split_groups_reach_the_count_within_the_budget():
    rng = random.Random(7)
    for _ in range(100):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(2, 24))]
        budget = rng.randint(40, 120)
        groups = token_budget_groups(lengths, budget)
        count = rng.randint(len(groups), len(lengths))
        split = split_groups(groups, lengths, count)
        assert len(split) == count and all(split)
        assert sorted(i for g in split for i in g) == list(range(len(lengths)))  # each row exactly once
        assert max(sum(lengths[i] for i in g) for g in split) <= budget
        assert split == split_groups(groups, lengths, count)  # deterministic: every rank plans alike
    # the heaviest group is the one split, longest row first into the lighter half
    assert split_groups([[0, 1], [2, 3, 4]], [5, 5, 9, 4, 3], 3) == [[0, 1], [2], [3, 4]]
    assert split_groups([[0], [1]], [5, 5], 4) == [[0], [1]]  # single rows cannot split further


def test_balanced_shares_even_out_tokens_in_equal_counts():
    lengths = [40, 39, 38, 37, 5, 4, 3, 2]
    shares = balanced_shares(lengths, 2)
    assert shares == [[0, 3, 4, 7], [1, 2, 5, 6]]  # 84 tokens each; contiguous halves would be 154 against 14
    assert balanced_shares(lengths, 1) == [list(range(8))]  # one rank: the mini-batch as it was
    rng = random.Random(3)
    for _ in range(50):
        parts = rng.choice([2, 3, 4])
        lengths = [rng.randint(1, 60) for _ in range(parts * rng.randint(1, 6))]
        shares = balanced_shares(lengths, parts)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        assert {len(s) for s in shares} == {len(lengths) // parts}
        loads = [sum(lengths[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one row


def test_micro_batches_run_the_agreed_count_or_refuse():
    batch = _rollout([(3, 30), (3, 2), (3, 2), (3, 2)])  # 33 + 3 x 5 tokens: one group of 48 under a budget of 50
    assert [g.tolist() for g in micro_batches(batch, 2, 50)] == [[0, 1, 2, 3]]
    assert [g.tolist() for g in micro_batches(batch, 2, 50, count=3)] == [[0], [1, 3], [2]]
    with pytest.raises(ValueError, match="4 rows cannot make the 5 micro-batches another rank runs"):
        micro_batches(batch, 2, 50, count=5)


def test_update_shares_are_planned_alike_for_every_rank():
    from portagrpo.train.update import rank_shares

    lengths = [(10, 30), (10, 1), (10, 29), (10, 2), (10, 28), (10, 3), (10, 27), (10, 4)]
    rollout = _rollout(lengths)
    mini = torch.tensor([6, 1, 4, 3, 0, 5, 2, 7])
    plain = rank_shares(rollout, mini, 2, balance=False)
    assert [s.tolist() for s in plain] == [[6, 1, 4, 3], [0, 5, 2, 7]]
    shares = rank_shares(rollout, mini, 2, balance=True)
    assert sorted(torch.cat(shares).tolist()) == list(range(8))
    tokens = [sum(sum(lengths[i]) for i in s.tolist()) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= 2, tokens

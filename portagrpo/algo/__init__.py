"""GRPO/DrGRPO math as pure tensor functions (docs/design.md "Numerics contract")."""
from portagrpo.algo.advantages import (
    ADV_ESTIMATORS,
    batch_normalize_scores,
    clip_advantages,
    clip_scores,
    group_advantages,
    kl_penalized_scores,
    whiten_advantages,
)
from portagrpo.algo.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    aggregate_loss,
    clipped_policy_loss,
    entropy_from_logits,
    full_kl,
    kl_penalty,
    loss_normalizers,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "aggregate_loss",
    "batch_normalize_scores",
    "clip_advantages",
    "clip_scores",
    "clipped_policy_loss",
    "entropy_from_logits",
    "full_kl",
    "group_advantages",
    "kl_penalized_scores",
    "kl_penalty",
    "loss_normalizers",
    "whiten_advantages",
]

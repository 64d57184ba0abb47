"""Rollout engines by name: engines.py (the registry, `hf`, `fixed`, sampling settings, the one
prompt -> responses path), vllm.py (the `vllm` engine, imported only when chosen)."""
from portagrpo.rollout.engines import (
                                       ROLLOUT_ENGINES,
                                       FixedRollout,
                                       HFRollout,
                                       RolloutEngine,
                                       decode_responses,
                                       rollout_groups,
                                       stop_token_ids,
)
from portagrpo.rollout.settings import SamplingParams

__all__ = ["ROLLOUT_ENGINES", "FixedRollout", "HFRollout", "RolloutEngine", "SamplingParams", "decode_responses",
           "rollout_groups", "stop_token_ids"]

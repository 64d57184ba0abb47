"""Rewards: functions.py (the registry, built-in rewards, user files, batch scoring), pool.py
(scoring in worker processes with deadlines), math_answers.py (answer normalisation for MATH)."""
from portagrpo.rewards.functions import REWARDS, RewardFunctionError, RewardResolver, RewardSpecError, score_responses

__all__ = ["REWARDS", "RewardFunctionError", "RewardResolver", "RewardSpecError", "score_responses"]

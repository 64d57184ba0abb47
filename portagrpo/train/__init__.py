"""The training loop and its phases (see loop.py)."""
from portagrpo.train.experience import Experience
from portagrpo.train.loop import Cadence, StepOutput, Trainer, default_run_dir

__all__ = ["Cadence", "Experience", "StepOutput", "Trainer", "default_run_dir"]

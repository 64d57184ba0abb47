"""The training loop and its parts (see loop.py)."""
from portagrpo.train.driver import Cadence
from portagrpo.train.experience import Experience
from portagrpo.train.loop import StepOutput, Trainer, default_run_dir

__all__ = ["Cadence", "Experience", "StepOutput", "Trainer", "default_run_dir"]

"""Training: the loop over steps (loop.py), the Trainer (trainer.py) and their parts."""
from portagrpo.train.experience import Experience
from portagrpo.train.loop import Cadence
from portagrpo.train.trainer import StepOutput, Trainer, default_run_dir

__all__ = ["Cadence", "Experience", "StepOutput", "Trainer", "default_run_dir"]

"""The training loop and its phases (see loop.py)."""
from .experience import Experience
from .loop import Cadence, StepOutput, Trainer, default_run_dir

__all__ = ["Cadence", "Experience", "StepOutput", "Trainer", "default_run_dir"]

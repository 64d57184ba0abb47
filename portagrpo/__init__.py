"""portagrpo: GRPO/DrGRPO training with the same numbers on CUDA, ROCm, Ascend NPU and the CPU."""
__version__ = "0.1.0"

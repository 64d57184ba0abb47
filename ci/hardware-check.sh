#!/usr/bin/env bash
# The hardware check of one device, as a person or a CI runner on that machine runs it:
#   ci/hardware-check.sh DEVICE [OUT] [--size full|tiny]
# doctor, parity (fp32, bf16, every kernel), the device-marked tests, a CPU recording replayed on DEVICE,
# 30-step runs of a Qwen2.5-0.5B-shaped random model under every parallel strategy and engine the machine
# has, bench kernels and bench step; one report in OUT (report.md, report.json). Exit 1 if a step failed.
# CI runs it with cpu and emu at --size tiny (tests/integration/test_hardware_check.py).
set -euo pipefail
exec python -m portagrpo hardware-check "$@"

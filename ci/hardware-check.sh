#!/usr/bin/env bash
# The hardware check of one device, as a person or a CI runner on that machine runs it:
#   ci/hardware-check.sh DEVICE [OUT] [--size full|tiny] [--tests DIR]
# doctor, parity (fp32, bf16, every kernel), the device-marked tests, a CPU recording replayed on DEVICE,
# 30-step runs of a Qwen2.5-0.5B-shaped random model under every parallel strategy and engine the machine
# has, bench kernels and bench step; one report in OUT (report.md, report.json). Exit 1 if a step failed.
# `--size tiny` runs every step once at the smallest size (minutes on a CPU). It runs the installed
# portagrpo from any directory: a relative OUT is made absolute once, the steps run in OUT, and the
# device-marked tests are taken from --tests, else ./tests/parity (a clone, the images' WORKDIR), else
# skipped with the reason. Same command: `portagrpo hardware-check DEVICE ...` (`--help` for the options).
# CI runs it with cpu and emu at --size tiny (tests/integration/test_hardware_check.py), and from an
# installed wheel (tests/integration/test_installed_wheel.py).
set -euo pipefail
# python3, as the images' own RUN lines use (some base images have no `python`); PYTHON overrides it.
PY=${PYTHON:-python3}
# -P (Python 3.11+) keeps the current directory off sys.path, so a source tree there (the images keep their
# WORKDIR at one) cannot shadow the installed package: the same rule as the ranks (procs.portagrpo_command).
if "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  exec "$PY" -P -m portagrpo hardware-check "$@"
fi
exec "$PY" -m portagrpo hardware-check "$@"

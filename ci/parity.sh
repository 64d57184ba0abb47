#!/usr/bin/env bash
# Run the parity suite for one backend, as a person or a CI runner would:
#   ci/parity.sh DEVICE [DTYPES] [OUT_DIR]
# DEVICE: cpu|cuda|rocm|npu; DTYPES: comma-separated (default fp32,bf16); OUT_DIR: where the
# JSON reports go (default parity-reports). Exits non-zero if the backend is unusable or any
# stage is outside the tolerance table.
set -euo pipefail
DEVICE=${1:?usage: ci/parity.sh DEVICE [DTYPES] [OUT_DIR]}
DTYPES=${2:-fp32,bf16}
OUT=${3:-parity-reports}
mkdir -p "$OUT"

portagrpo doctor --require "$DEVICE" | tee "$OUT/doctor-$DEVICE.txt"
portagrpo doctor --json > "$OUT/doctor-$DEVICE.json"

KERNELS=reference,chunked
if python -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('triton') else 1)" \
   && [ "$DEVICE" != cpu ] && [ "$DEVICE" != npu ]; then
  KERNELS=$KERNELS,triton
fi
portagrpo parity --device "$DEVICE" --dtype "$DTYPES" --kernels "$KERNELS" --json "$OUT/parity-$DEVICE.json"
python -m pytest -q -p no:cacheprovider -m "$DEVICE" tests/parity --junitxml "$OUT/pytest-parity-$DEVICE.xml"

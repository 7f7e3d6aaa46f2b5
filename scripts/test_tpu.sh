#!/usr/bin/env bash
# The TPU tier (tests/tpu_tier.txt) in one process, as `make test-tpu` runs
# it: on the chip where JAX has one, within 9 minutes; its log in
# tpu-tier.log (TORCHTPU_TIER_LOG). With the project's .venv, from it; else
# (a TPU machine whose JAX is preinstalled and whose package index is local)
# after scripts/tpu_env.sh.
set -o pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    # What the tier imports beyond torch: torch's test internals (OpInfo,
    # ModuleInfo) need expecttest; the Hugging Face tests need the rest.
    export TORCHTPU_EXTRA_PACKAGES="${TORCHTPU_EXTRA_PACKAGES:-} expecttest transformers safetensors accelerate"
    . scripts/tpu_env.sh || exit 1
    PY=python3
fi
LOG=${TORCHTPU_TIER_LOG:-tpu-tier.log}
export TORCHTPU_CACHE_DIR=${TORCHTPU_CACHE_DIR:-off}
timeout ${TORCHTPU_TIER_SECONDS:-540} $PY -m pytest --tpu-tier -p no:cacheprovider -rfE --tb=short \
    --durations=15 tests "$@" 2>&1 | tee "$LOG"

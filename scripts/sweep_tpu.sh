#!/usr/bin/env bash
# Whole test files on the chip, one pytest process each with its own time
# limit, for the runs that take the suite across a TPU machine:
#   bash scripts/sweep_tpu.sh tests/test_amp.py:80 tests/test_training.py:60 ...
# Logs and a summary line per file in $OUT (default tpu-sweep/); BUDGET
# (seconds, default 500) bounds the whole sweep.
cd "$(dirname "$0")/.."
OUT=${OUT:-tpu-sweep}
mkdir -p "$OUT"
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else . scripts/tpu_env.sh >/dev/null 2>&1 || exit 1; PY=python3; fi
export TORCHTPU_CACHE_DIR=${TORCHTPU_CACHE_DIR:-off}
end=$((SECONDS + ${BUDGET:-500}))
for spec in "$@"; do
    f=${spec%%:*}; t=${spec##*:}; left=$((end - SECONDS))
    [ "$left" -lt 20 ] && break
    [ "$t" -gt "$left" ] && t=$left
    name=$(basename "$f" .py)
    timeout "$t" $PY -m pytest -q -rfE --tb=short -p no:warnings -p no:cacheprovider "$f" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary"
done

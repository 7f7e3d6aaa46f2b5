#!/usr/bin/env bash
# transformers' own model tests (tests/models/*/test_modeling_*.py) on the cpu
# or on the tpu device, one pytest process a file, each under a timeout.
#
#   scripts/hf_model_tests.sh DEVICE MODE OUTDIR FILE...
#   scripts/hf_model_tests.sh cpu -      /tmp/hf_model_runs gpt2 llama bert t5 mistral vit
#   scripts/hf_model_tests.sh tpu strict /tmp/hf_model_runs gpt2 llama bert t5 mistral vit
#   scripts/hf_model_tests.sh tpu fused  /tmp/hf_model_runs gpt2 llama
#   python scripts/hf_model_report.py /tmp/hf_model_runs cpu-- tpu-strict
#
# FILE is a model name (tests/models/NAME/test_modeling_NAME.py) or a path
# under the test tree. The test tree is $HF_TESTS (default /tmp/hf_tests):
# a folder holding transformers' tests/ package for the installed
# transformers (the sdist of the same version ships tests/ with the common
# mixins; tests/generation/, tests/exporters/ and the model folders come
# from the transformers repository), with
# src/transformers a link to the installed package (the mixins import it from
# there) and _deps/ holding `pip install --target` of parameterized. It is
# not part of this repository. DEVICE tpu sets TRANSFORMERS_TEST_BACKEND=torchtpu
# (transformers' testing_utils imports torchtpu before choosing the device)
# and TRANSFORMERS_TEST_DEVICE=tpu; MODE is TORCHTPU_MODE (debug, strict,
# fused; "-" for the cpu runs). DEVICE cpu imports no torchtpu.
#
# Each run writes OUTDIR/NAME.DEVICE-MODE.{xml,log} (junit XML and pytest's
# output) and a line "NAME DEVICE MODE rc SECONDS" to OUTDIR/times.txt.
# Environment: PYTHON (default .venv/bin/python), HF_TIMEOUT (seconds a file,
# default 1500), HF_XDIST (pytest-xdist workers, default none: give 2 only
# on an otherwise idle machine), HF_PYTEST_ARGS (extra pytest arguments),
# HF_SYNC_EACH_TEST (default 1: tpu runs load scripts/hf_sync_each_test.py,
# which syncs after each test so a device-side index check fails the test
# whose op ran, not the next one; 0 leaves it out).
# Not part of `make test`.
set -uo pipefail

if [ $# -lt 4 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
DEVICE=$1
MODE=$2
OUT=$3
shift 3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
TREE=${HF_TESTS:-/tmp/hf_tests}
TIMEOUT=${HF_TIMEOUT:-1500}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ ! -d "$TREE/tests" ]; then
    echo "no transformers test tree at $TREE/tests (set HF_TESTS)" >&2
    exit 2
fi

# $TREE/_deps: test-only packages (parameterized) installed with pip --target
plugin=()
envs=(PYTHONPATH="$ROOT:$TREE/_deps${PYTHONPATH:+:$PYTHONPATH}")
case "$DEVICE" in
    tpu) envs+=(TRANSFORMERS_TEST_BACKEND=torchtpu TRANSFORMERS_TEST_DEVICE=tpu)
         [ "$MODE" != "-" ] && envs+=(TORCHTPU_MODE="$MODE")
         # each test's device-side checks read at its own end, not in the next test
         if [ "${HF_SYNC_EACH_TEST:-1}" != 0 ]; then
             envs[0]="${envs[0]}:$ROOT/scripts"
             plugin=(-p hf_sync_each_test)
         fi ;;
    cpu) envs+=(TRANSFORMERS_TEST_DEVICE=cpu) ;;
    *) echo "DEVICE is cpu or tpu" >&2; exit 2 ;;
esac
xdist=()
[ -n "${HF_XDIST:-}" ] && xdist=(-n "$HF_XDIST")

worst=0
for f in "$@"; do
    case "$f" in
        */*) path=$f; name=$(basename "$f" .py); name=${name#test_modeling_} ;;
        *) path=tests/models/$f/test_modeling_$f.py; name=$f ;;
    esac
    tag=$name.$DEVICE-$MODE
    start=$(date +%s)
    (cd "$TREE" && env "${envs[@]}" timeout -k 30 "$TIMEOUT" "$PY" -m pytest "$path" \
        -p no:cacheprovider "${plugin[@]}" -q -rfE "${xdist[@]}" --junitxml="$OUT/$tag.xml" \
        ${HF_PYTEST_ARGS:-}) >"$OUT/$tag.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    echo "$name $DEVICE $MODE $rc $secs" >>"$OUT/times.txt"
    echo "$tag: rc $rc, ${secs}s, $(tail -n 1 "$OUT/$tag.log")"
    # pytest: 0 all passed, 1 some failed; anything else (a timeout's 124,
    # a crash's signal) is worse
    [ $rc -gt 1 ] && worst=$rc
    [ $rc -eq 1 ] && [ $worst -eq 0 ] && worst=1
done
exit $worst

# Wheels the machine's index lacks (expecttest, on the machine measured
# here) can be brought along in TORCHTPU_WHEELS (default: ./tpu-wheels).
# Source on a TPU machine whose JAX (with libtpu) is installed and whose
# package index is local: installs torch's CPU build (and what else torchtpu
# needs that is missing, plus TORCHTPU_EXTRA_PACKAGES) under /tmp/site once,
# and puts it and this checkout on PYTHONPATH after the machine's own JAX.
#   . scripts/tpu_env.sh
SITE=${TORCHTPU_SITE:-/tmp/site}
_tpu_missing=""
[ -d "$SITE/torch" ] || _tpu_missing="torch==2.13.0 flatbuffers"
for _pkg in ${TORCHTPU_EXTRA_PACKAGES:-}; do
    # A distribution is there when its dist-info is (names normalized by pip).
    ls "$SITE" 2>/dev/null | grep -qi "^${_pkg//-/_}-.*\.dist-info$" || _tpu_missing="$_tpu_missing $_pkg"
done
if [ -n "$_tpu_missing" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
        --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --find-links /opt/wheels \
        --find-links "${TORCHTPU_WHEELS:-$(pwd)/tpu-wheels}" \
        --target "$SITE" $_tpu_missing || return 1
    # The machine's JAX, numpy and ml_dtypes must win over pip's copies.
    rm -rf "$SITE"/jax "$SITE"/jax-* "$SITE"/jaxlib* "$SITE"/numpy "$SITE"/numpy-* "$SITE"/ml_dtypes*
fi
# Byte-compiled once, as pip's own install would have: where the machine
# sets PYTHONDONTWRITEBYTECODE, every process would otherwise compile
# torch's and torchtpu's sources again at import (seconds of a start-up).
python3 -m compileall -q -j 0 "$SITE" torchtpu > /dev/null 2>&1 || true
unset _tpu_missing _pkg
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$(pwd)
export PYTHONUNBUFFERED=1

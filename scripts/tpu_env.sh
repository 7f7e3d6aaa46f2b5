# Source on a TPU machine whose JAX (with libtpu) is installed and whose
# package index is local: installs torch's CPU build (and what else torchtpu
# needs that is missing) under /tmp/site once, and puts it and this checkout
# on PYTHONPATH after the machine's own JAX.
#   . scripts/tpu_env.sh
SITE=${TORCHTPU_SITE:-/tmp/site}
if [ ! -d "$SITE/torch" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
        --no-compile --no-cache-dir --index-url file:///opt/pypi/simple --find-links /opt/wheels \
        --target "$SITE" torch==2.13.0 flatbuffers ${TORCHTPU_EXTRA_PACKAGES:-} || return 1
    # The machine's JAX, numpy and ml_dtypes must win over pip's copies.
    rm -rf "$SITE"/jax "$SITE"/jax-* "$SITE"/jaxlib* "$SITE"/numpy "$SITE"/numpy-* "$SITE"/ml_dtypes*
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$(pwd)
export PYTHONUNBUFFERED=1

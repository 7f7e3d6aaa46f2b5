#!/usr/bin/env bash
# torchtpu against another torch, JAX or Python: a throwaway venv with those
# versions, the core of the suite, and benchmarks/gpu.py --smoke.
#
#   scripts/check_versions.sh TORCH JAX [PYTHON]
#   scripts/check_versions.sh 2.11 0.10.2          # torch 2.11.*, JAX 0.10.2, python3
#   scripts/check_versions.sh 2.13.0 0.12 3.12     # Python 3.12 (on PATH or pyenv's)
#
# A torch other than the CPU build on this machine's disk is a CUDA build
# from PyPI (about 3 GB, once: pip caches it). The venv is kept in
# .venvs/ (ignored by git) so a second run installs nothing; delete it to
# start over. Not part of `make test`.
set -euo pipefail

if [ $# -lt 2 ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
TORCH=$1
JAX=$2
PYTHON=${3:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

spec() {  # "2.11" -> "==2.11.*"; "2.11.0" -> "==2.11.0"
    case "$1" in
        *.*.*) echo "==$1" ;;
        *) echo "==$1.*" ;;
    esac
}

if [ -z "$PYTHON" ]; then
    INTERP=$(command -v python3)
elif "python$PYTHON" -c pass >/dev/null 2>&1; then  # (a pyenv shim may not run)
    INTERP=$(command -v "python$PYTHON")
else
    INTERP=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYTHON"*/bin/python 2>/dev/null | sort -V | tail -1)
    if [ -z "$INTERP" ]; then
        echo "no Python $PYTHON: neither python$PYTHON on PATH nor a pyenv version" >&2
        exit 2
    fi
fi
PYVER=$("$INTERP" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VENV="$ROOT/.venvs/torch$TORCH-jax$JAX-py$PYVER"

if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    "$INTERP" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "torch$(spec "$TORCH")" "jax$(spec "$JAX")" "jaxlib$(spec "$JAX")"
    # The project and its test extras; the torch and JAX above satisfy its ranges.
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    touch "$VENV/.installed"
fi

cd "$ROOT"
"$VENV/bin/python" -c 'import sys, torch, jax; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, JAX {jax.__version__}")'
start=$(date +%s)
"$VENV/bin/python" -m pytest -n 2 -p no:cacheprovider \
    tests/test_modes.py tests/test_training.py tests/test_fused.py tests/test_cache.py \
    tests/test_compile.py tests/test_graphs.py tests/test_serialization.py
"$VENV/bin/python" benchmarks/gpu.py --smoke
echo "check_versions: torch $TORCH, JAX $JAX, Python $PYVER passed in $(( $(date +%s) - start )) s"

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# JAX's TPU build (the tpu extra) on a TPU machine: TORCHTPU_TPU=1, or =auto
# (the default) where the machine has a TPU's device files; =0 never.
TORCHTPU_TPU ?= auto
comma := ,
ifeq ($(TORCHTPU_TPU),auto)
TPU_EXTRA := $(if $(wildcard /dev/accel* /dev/vfio/[0-9]*),$(comma)tpu)
else ifeq ($(TORCHTPU_TPU),1)
TPU_EXTRA := $(comma)tpu
endif

.PHONY: install test test-tpu demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build this machine has on disk; pyproject.toml admits 2.11-2.13.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test$(TPU_EXTRA)]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

# The TPU tier of the suite (tests/tpu_tier.txt), in one process on the chip.
test-tpu:
	bash scripts/test_tpu.sh

demo: install
	$(PY) examples/train_cuda_script.py

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV)

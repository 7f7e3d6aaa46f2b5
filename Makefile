VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build this machine has on disk; pyproject.toml admits 2.11-2.13.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

demo: install
	$(PY) examples/train_cuda_script.py

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV)

# CPU machine: torch is pinned to the local +cpu wheel *before* the package is
# installed, so the loose torch range in pyproject.toml never pulls CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv test demo bench clean distclean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[test]'
	touch $@

# two workers: while one test's rank 0 plans alone (its other ranks wait), the other worker uses the
# second core; whole files go to one worker, so a module's fixtures are built once
test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests -n 2 --dist loadfile --durations=25

demo: venv
	$(PY) examples/demo_gpt.py

bench: venv
	$(PY) benchmarks/run_all.py

# clean keeps .venv (slow to rebuild, shared by everyone working here); distclean drops it.
clean:
	rm -rf build *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)

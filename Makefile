# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both build .venv with Python 3.12 on first use (jax 0.11 needs >= 3.12).
PYTHON312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12 2>/dev/null | head -n 1)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (set PYTHON312=/path/to/python3.12)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/hisparse demo

# Two workers (pytest-xdist), one test module each at a time: compiling is most
# of the suite's time and runs on one core per process.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope

clean:
	rm -rf $(VENV)

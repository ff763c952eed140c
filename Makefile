# Two entry points: `make demo` (the main job) and `make test` (the whole suite: the
# main suite in .venv and, beside it, the vLLM bridge's suite in .venv-vllm).
# .venv: Python 3.12 (jax 0.11 needs >= 3.12), built on first use.
# .venv-vllm: Python 3.11, vLLM's CPU build, torch (CPU), jax 0.10.2 and hisparse
# editable, built on first use by bridge/setup_env.sh (docs/log/vllm.md).
PYTHON312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1 && echo python3.12 || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12 2>/dev/null | head -n 1)
PYTHON311 ?= $(shell command -v python3.11 >/dev/null 2>&1 && python3.11 -c 'import sys' >/dev/null 2>&1 && echo python3.11 || ls -d $$HOME/.pyenv/versions/3.11*/bin/python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11 2>/dev/null | head -n 1)
VENV := .venv
PY := $(VENV)/bin/python
VENV_VLLM := .venv-vllm

.PHONY: demo test test-main test-bridge venv venv-vllm clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (set PYTHON312=/path/to/python3.12)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[all]"
	touch $@

# One command, idempotent: it reuses a finished env (refreshing hisparse's editable
# install when pyproject.toml changed) and writes the stamp itself. Without Python 3.11
# it stops with one line: "error: Python 3.11 not found ...".
$(VENV_VLLM)/.installed: pyproject.toml bridge/setup_env.sh
	PYTHON311="$(PYTHON311)" bash bridge/setup_env.sh $(VENV_VLLM)

venv: $(VENV)/.installed

venv-vllm: $(VENV_VLLM)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/hisparse demo

# Two workers (pytest-xdist), one test module each at a time: compiling is most
# of the suite's time and runs on one core per process.
TEST_WORKERS ?= 2
TEST_MAIN = $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope
# One process: the engine and server tests start vLLM engines of their own. The
# SmolLM2 checkpoint they serve is exported once by .venv's `hisparse export`.
# The bridge env is also the library's low end (Python 3.11, jax 0.10.2): the cache,
# its codecs and config run there too, on the XLA path.
TEST_BRIDGE = $(VENV_VLLM)/bin/python -m pytest tests/bridge tests/test_config.py \
	tests/test_codecs.py tests/test_cache.py -k "not pallas"

test-main: $(VENV)/.installed
	$(TEST_MAIN)

test-bridge: $(VENV)/.installed $(VENV_VLLM)/.installed
	$(TEST_BRIDGE)

# Both envs are built first (a missing Python fails at once), then both suites run
# side by side: the bridge suite is one process that keeps about one core busy (its
# vLLM engines start up on one), the main suite's two workers about 1.8 of two, so
# together they take about the compute of both, not the sum of their times. The
# bridge's output, kept in a file, follows the main suite's; `make test` fails if
# either suite does.
# (A background job of a non-interactive shell ignores SIGINT: the trap stops it.)
test: $(VENV)/.installed $(VENV_VLLM)/.installed
	@failed=""; log=$$(mktemp); \
	echo "$(TEST_BRIDGE) (beside the main suite; its output follows)"; \
	$(TEST_BRIDGE) > $$log 2>&1 & bridge=$$!; \
	trap 'kill $$bridge 2>/dev/null; rm -f $$log; exit 130' INT TERM; \
	echo "$(TEST_MAIN)"; $(TEST_MAIN) || failed="$$failed main"; \
	wait $$bridge || failed="$$failed bridge"; \
	echo "---- the bridge suite:"; cat $$log; rm -f $$log; \
	if [ -n "$$failed" ]; then echo "make test: FAILED suite(s):$$failed"; exit 1; fi; \
	echo "make test: main and bridge suites passed"

clean:
	rm -rf $(VENV) $(VENV_VLLM)

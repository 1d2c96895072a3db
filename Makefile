# hetserve: `make run` (set up, pull the default model, generate) and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
MODEL  ?= qwen2.5-coder-0.5b-instruct
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: install run test bench clean

# Rebuilt when the kernels' sources change too: every variant is compiled here, not only the one
# the first run loads (the avx512 one on an AVX2 machine is otherwise left stale).
$(VENV)/.installed: pyproject.toml $(wildcard src/hetserve/layers/csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(PY) -m hetserve.layers.native
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/hetserve pull $(MODEL)
	$(VENV)/bin/hetserve generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens 160 --temperature 0

test: install
	@# The web page's browser tests use Debian's chromium (they skip, saying why, without one).
	@command -v chromium >/dev/null || (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq chromium) || echo "chromium not installed: the browser tests will skip"
	$(PY) -m pytest -q -ra --durations=25

bench: install
	$(VENV)/bin/hetserve bench latency --model $(MODEL) --prompt-tokens 512 --output-tokens 128

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

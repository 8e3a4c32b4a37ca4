# The README's two commands are `make demo` and `make test`; everything else is here too.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup services demo test lint format worker beat flower bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

services:
	@scripts/services

demo: setup
	$(BIN)/agentruns demo

test: setup services
	$(BIN)/pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check agentruns workers tests bench celeryconfig.py
	$(BIN)/ruff format --check agentruns workers tests bench celeryconfig.py
	$(BIN)/mypy --strict agentruns

format: setup
	$(BIN)/ruff check --fix agentruns workers tests bench celeryconfig.py
	$(BIN)/ruff format agentruns workers tests bench celeryconfig.py

worker: setup
	$(BIN)/celery -A agentruns worker -P threads -c 64 --loglevel=INFO -E

beat: setup
	$(BIN)/celery -A agentruns beat --loglevel=INFO

flower: setup
	$(BIN)/celery -A agentruns flower --address=127.0.0.1

bench: setup services
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache agentruns.db celerybeat-schedule*

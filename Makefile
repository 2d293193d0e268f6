# `make train` and `make test` each do all the set-up on a fresh machine: a virtual environment in .venv with
# the project installed (editable), then the job.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs outputs

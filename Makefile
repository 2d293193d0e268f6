# `make train` and `make test` each do all the set-up on a fresh machine: a virtual environment in .venv with
# the project installed (editable), then the job. `make train` installs only what training needs; `make test`
# adds the test extras (pytest, matplotlib, psutil, DALI, onnx, onnxscript and onnxruntime: several GB more).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: train test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -e ".[test]"
	touch $(TEST_STAMP)

train: $(STAMP)
	$(BIN)/python train.py

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs outputs

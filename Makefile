# `make demo` and `make test` work on a fresh machine with only Python: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean fuzz survey opinfo docs

$(STAMP): requirements-test.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-test.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python examples/demo.py

# Two pytest workers (pytest-xdist; TEST_WORKERS=0 runs in one process), each with its own gloo pools;
# a file's tests stay together on one worker (--dist loadfile: in order, sharing the file's cached plans).
# --durations=20 prints the 20 slowest tests, so that the next slowdown shows.
TEST_WORKERS ?= 2
# tests/docs/ensure_chromium.sh installs Debian's chromium for the browser tests where missing (never fails).
test: $(STAMP) lint
	sh tests/docs/ensure_chromium.sh
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=20 tests

# The docs site (issue 49): its own venv (mkdocs, mkdocs-material, mkdocstrings, pinned in requirements-docs.txt;
# no torch: the API pages are read from the docstrings statically), then a strict build into site/, where a broken
# link, a missing anchor or an unresolved API name fails. CI (.ci/run) runs it before `make test`.
DOCS_VENV := .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed
$(DOCS_STAMP): requirements-docs.txt
	$(PY) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# Ruff: lint and format check (the formatter keeps lines to 120; pyproject.toml [tool.ruff]).
LINTED := autopar tests bench fuzz examples docs/_hooks
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

# Benchmarks: one markdown table, results in bench/results.json (bench/RESULTS.md: last figures).
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.run

# Property-based fuzzing beyond CI's 200 cases; failures land in fuzz/failures/*.json (replayable);
# then the tests marked `slow` (left out of `make test` to keep CI under 15 minutes).
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m fuzz.run --examples $${FUZZ_EXAMPLES:-2000}
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow tests

# PyTorch's OpInfo database against autopar (issue 31): every sample planned and checked against serial;
# the per-class counts and the ops still on fallback go in docs/opinfo.md (~40 min on 2 vCPUs).
opinfo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m fuzz.opinfo --json fuzz/opinfo-results.json; \
	$(BIN)/python -m fuzz.opinfo_report fuzz/opinfo-results.json docs/opinfo.md

clean:
	rm -rf $(VENV) $(DOCS_VENV) site .pytest_cache

# Every architecture of the installed transformers, tiny, planned and checked: bench/SURVEY.md (~1 h on 2 vCPUs).
survey: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.survey -j $${SURVEY_JOBS:-2} --limit $${SURVEY_LIMIT:-120}

# `make demo` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rankwatch-installed

.PHONY: demo test test-fast setup bench lint docs clean typecheck

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_system.sh
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi
	bash scripts/install_torch.sh $(PY)
	bash scripts/install_system.sh
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rankwatch demo

typecheck: $(STAMP)
	$(PY) -m mypy --config-file pyproject.toml src/rankwatch benchmarks

test: typecheck
	$(PY) -m pytest -q

# the unit tests not marked slow (no ranks spawned, no notebook executed, no wheel built): your own loop
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests/unit

bench: $(STAMP)
	$(PY) benchmarks/collector_overhead.py

lint: typecheck

docs: $(STAMP)
	$(PY) -c "from rankwatch.base.schema import render_markdown; print(render_markdown(), end='')" > docs/telemetry.md
	$(PY) -c "from pathlib import Path; from rankwatch.recovery.policy import write_decision_doc; write_decision_doc(Path('docs/recovery.md'))"

clean:
	rm -rf $(VENV) build dist src/*.egg-info

# `make demo` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rankwatch-installed

.PHONY: demo test setup bench lint docs clean typecheck

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

# mypy names modules by folder; the checkout's folder may have any name, so check it through a link named
# after the package.
MYPY_ROOT := .mypy-root
TYPED := collector trainer analytics simulator cli.py monitor.py drills.py benchmarks

typecheck: $(STAMP)
	rm -rf $(MYPY_ROOT) && mkdir -p $(MYPY_ROOT) && ln -s "$(CURDIR)" $(MYPY_ROOT)/rankwatch
	cd $(MYPY_ROOT) && "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" $(addprefix rankwatch/,$(TYPED))

test: typecheck
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/collector_overhead.py

lint: typecheck

docs: $(STAMP)
	$(PY) -c "from rankwatch.collector.schema import render_markdown; print(render_markdown(), end='')" > docs/telemetry.md
	$(PY) -c "from pathlib import Path; from rankwatch.analytics.recovery import write_decision_doc; write_decision_doc(Path('docs/recovery.md'))"

clean:
	rm -rf $(VENV) build dist *.egg-info $(MYPY_ROOT)

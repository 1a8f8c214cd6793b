# Colibri: `make run` and `make test` set everything up on a fresh Debian 12 machine, then run.
# The virtual environment lives in .venv, caches in .cache; `make clean` removes both.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
CACHE := $(CURDIR)/.cache
PYTEST_ARGS ?=
# pytest-xdist workers; a test module stays in one worker (its fixtures are made once), handed out in the
# order tests/conftest.py gives (heaviest compiles first). Two fill this
# project's two-core CI machine; TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder)

# Debian packages the tests need; installed by `system-deps` when missing (with sudo unless root).
# The desktop app (Qt's xcb platform, OpenGL through Mesa) and the GUI tests' virtual display (Xvfb):
DEBIAN_PACKAGES := libgl1 libegl1 libgl1-mesa-dri libfontconfig1 libfreetype6 libglib2.0-0 libdbus-1-3 \
	libx11-6 libxkbcommon0 xvfb xauth libx11-xcb1 libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 \
	libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-render0 libxcb-shape0 \
	libxcb-shm0 libxcb-sync1 libxcb-util1 libxcb-xfixes0 libxcb-xkb1 \
	desktop-file-utils

# Re-install only when pyproject.toml changes: one stamp per set of dependencies. --no-compile: Python compiles a
# module's bytecode when it is first imported, so pip's compiling of every file it installs (torch's thousands) is
# time spent on modules nothing imports.
PIP_FLAGS := --no-compile
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test

.PHONY: help run test test-fast lint system-deps venv clean package translations

help: ## list the targets
	@echo "Colibri: make TARGET"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  \1\t/' | expand -t 16

run: system-deps $(RUNTIME_STAMP) ## set up and open the app on the default model (SmolLM2-135M upcycled to an MoE); the window prepares it with progress the first time
	@if $(VENV)/bin/colibri gui --check-display; then \
		$(VENV)/bin/colibri gui smollm2-moe; \
	else \
		echo "make run: so the terminal chat opens instead, once the model is prepared (Ctrl-D leaves)" >&2; \
		$(VENV)/bin/colibri warm smollm2-moe && \
		$(VENV)/bin/colibri chat smollm2-moe; \
	fi

test: system-deps $(TEST_STAMP) ## set up with the test extra (torch, transformers) and run pytest
	NUMBA_CACHE_DIR=$(CACHE)/numba XDG_CACHE_HOME=$(CACHE)/xdg HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE \
		$(VENV_PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# The fast subset: no parity against transformers, no GUI, none of the slow tests (pytest markers in pyproject.toml).
FAST_MARKERS := not slow and not gui and not parity

test-fast: system-deps $(TEST_STAMP) ## run the fast subset of the tests (no slow, gui or parity markers)
	NUMBA_CACHE_DIR=$(CACHE)/numba XDG_CACHE_HOME=$(CACHE)/xdg HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE \
		$(VENV_PY) -m pytest $(XDIST) -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# Every check runs and reports; the target fails if any of them did.
lint: $(TEST_STAMP) ## check style (ruff), types of the engine's core (mypy) and who imports whom (import-linter)
	@status=0; \
	for check in "$(VENV)/bin/ruff check ." "$(VENV)/bin/mypy" "$(VENV)/bin/lint-imports --cache-dir $(CACHE)/import-linter"; do \
		echo "$$check"; $$check || status=1; \
	done; \
	exit $$status

package: system-deps $(RUNTIME_STAMP) ## build the desktop app into dist/colibri (PyInstaller); packaging/install.sh installs it
	packaging/build.sh

# The Chinese UI: lupdate gathers the translatable strings of ui/ into the .ts (new ones unfinished: translate them
# there, by hand or in pyside6-linguist), lrelease compiles the .qm the app loads; both files are committed, and
# tests/gui/test_gui_translation.py checks that every string is translated and the .qm is up to date.
TS := ui/i18n/colibri_zh_CN.ts

translations: $(RUNTIME_STAMP) ## update ui/i18n/colibri_zh_CN.ts from the strings in ui/ and compile its .qm
	$(VENV)/bin/pyside6-lupdate -no-obsolete -locations relative -target-language zh_CN \
		$(sort $(wildcard ui/*.py ui/*/*.py)) -ts $(TS)
	$(VENV)/bin/pyside6-lrelease -nounfinished $(TS) -qm $(TS:.ts=.qm)

venv: $(RUNTIME_STAMP) ## create .venv with the runtime dependencies only

system-deps: ## install the Debian packages of DEBIAN_PACKAGES that are missing
	@missing=""; \
	for pkg in $(DEBIAN_PACKAGES); do \
		dpkg -s "$$pkg" 2>/dev/null | grep -q '^Status: install ok installed' || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
		if ! command -v apt-get >/dev/null; then \
			echo "system-deps: no apt-get here; install these packages yourself:$$missing" >&2; exit 1; \
		fi; \
		sudo=""; \
		if [ "$$(id -u)" -ne 0 ]; then \
			command -v sudo >/dev/null || { echo "system-deps: as root, run: apt-get install$$missing" >&2; exit 1; }; \
			sudo="sudo"; \
		fi; \
		echo "system-deps: installing$$missing"; \
		$$sudo apt-get update && \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi

$(VENV_PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Colibri needs Python >= 3.11"' || \
		{ echo "make: set PYTHON=python3.11 (or newer)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
		echo "make: '$(PYTHON) -m venv' failed; on Debian: sudo apt-get install python3-venv" >&2; exit 1; }

# torch==2.13.0 is pinned in the test extra: pip takes the CPU wheel from /opt/wheels, never another build.
$(TEST_STAMP): pyproject.toml | $(VENV_PY)
	$(VENV_PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	touch $(RUNTIME_STAMP) $@

$(RUNTIME_STAMP): pyproject.toml | $(VENV_PY)
	$(VENV_PY) -m pip install $(PIP_FLAGS) -e .
	touch $@

clean: ## remove .venv and .cache
	rm -rf $(VENV) $(CACHE)

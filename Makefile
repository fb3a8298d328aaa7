# lightship front door: every target creates .venv on first use (torch CPU wheel first).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEFAULT_RUN := runs/default
RUN    ?= $(DEFAULT_RUN)
CONFIG ?= configs/digits.yaml
RESUME ?=
ARGS   ?=
EXPORT_ARGS ?=
QUANTIZE_ARGS ?=
REPORT_ARGS ?=
SERVE_ARGS ?=
BENCH_SERVE_ARGS ?=
TORCH  := torch==2.13.0
IMAGE  ?= lightship-serve
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml 2>/dev/null)

# A stage's `next:` line names no stage this make runs after it (`make train export`; a recipe
# that runs another stage after its own adds it; LIGHTSHIP_MAKE_THEN: the stage make runs next
# only where the run lacks it, export after a training run for a run without best.ckpt).
export LIGHTSHIP_MAKE_GOALS := $(MAKECMDGOALS)
# The folder make was run from (`make -C CHECKOUT`): a `make ...` in a message says -C then.
export LIGHTSHIP_MAKE_FROM := $(PWD)
here = $(if $(and $(PWD),$(filter-out $(CURDIR),$(realpath $(PWD)))),-C $(call q,$(CURDIR)) )
# ... and a lightship command, run where .venv and the run's relative path are.
cd_here = $(if $(here),cd $(call q,$(CURDIR)) && )

# A misspelt variable (`EXPRT_ARGS=...`) would be ignored without a word, as make does.
variables := RUN CONFIG RESUME ARGS EXPORT_ARGS QUANTIZE_ARGS REPORT_ARGS SERVE_ARGS \
	BENCH_SERVE_ARGS IMAGE TORCH PYTHON BIN STAMP
$(foreach v,$(.VARIABLES),$(if $(and $(filter command line,$(origin $(v))),$(filter-out \
	$(variables),$(v))),$(warning note: $(v) is not a variable of this Makefile and is ignored \
	(`make help` lists them))))

# The stages of one run run one after another: with -j (or MAKEFLAGS=-jN in a profile) make
# started a stage twice on one run, and the second stopped on the run's lock, failing the make.
.NOTPARALLEL:
# A path as one word for bash.
q = '$(subst ','"'"',$(1))'
lparen := (
rparen := )
lbrace := {
# What a path given to make may not hold: a space splits it into arguments; make reads RUN in
# a rule's target ($(RUN)/best.ckpt:), where these mean other things; bash reads the recipes.
# src/lightship/runs.py prints lightship's own command for such a run, not make's.
unsafe_chars := : % ; * ? [ ] \ | ' " ` & < > { } $(lparen) $(rparen)
unsafe = $(strip $(foreach c,$(unsafe_chars),$(findstring $(c),$(1))) $(if $(filter file \
	default,$(origin $(2))),,$(findstring $$,$(value $(2)))))
stage := $(or $(firstword $(filter train export quantize report serve,$(MAKECMDGOALS))),export)
# make reads a `$` in a value given to it as its own variable: ARGS='--set data.path=$HOME/x'
# reached lightship as `OME/x`, without a word. ($$ is make's escape for one `$`; $(X) and
# ${X} are taken as meant for make.)
$(foreach v,$(filter ARGS %_ARGS,$(variables)),$(if $(and $(filter command line \
	environment,$(origin $(v))),$(findstring $$,$(subst $$$(lparen),,$(subst $$$(lbrace),,$(subst \
	$$$$,,$(value $(v))))))),$(warning note: make reads each \
	$$ in $(v) as one of its own variables ($$HOME as $$H then OME): write $$$$ for a $$ lightship \
	should see, or let the shell expand it ($(v)="...$$HOME...", in double quotes))))
# An empty RUN (`make export RUN=`) or one with a space would reach lightship as other
# arguments, and its error would name those.
ifeq ($(strip $(RUN)),)
$(error RUN must name a run directory, e.g. RUN=runs/default (got ''))
endif
ifneq ($(words $(RUN))$(call unsafe,$(RUN),RUN),1)
$(error RUN must be one run directory without spaces or any of $(unsafe_chars) $$, e.g. \
	RUN=runs/default (got $(call q,$(value RUN))); for such a path call lightship itself: \
	`$(cd_here)$(BIN)/lightship $(stage) --run $(call q,$(value RUN))`)
endif
ifneq ($(words $(CONFIG))$(call unsafe,$(CONFIG),CONFIG),1)
$(error CONFIG must be one file without spaces or any of $(unsafe_chars) $$, e.g. \
	CONFIG=configs/digits.yaml (got $(call q,$(value CONFIG))): copy it to such a path, or call \
	lightship itself: `$(cd_here)$(BIN)/lightship train --run $(RUN) --config $(call \
	q,$(value CONFIG))`)
endif

# Made by a recipe that goes on after writing them (export writes ONNX first, then the other
# formats): on Ctrl-C make deleted the model.onnx lightship said it kept.
.PRECIOUS: $(RUN)/best.ckpt $(RUN)/export/model.onnx

# A checkout moved or renamed after `make setup`: .venv's commands still name the Python of
# the old folder, and every target failed with "cannot execute: required file not found". (A
# path with a space has pip write `#!/bin/sh` and the Python on a later line: not checked.)
venv_python := $(shell sed -n '1s/^\#!//p' $(VENV)/bin/lightship 2>/dev/null)
ifeq ($(and $(venv_python),$(filter-out /bin/sh,$(venv_python)),$(if $(wildcard \
	$(venv_python)),,missing)),missing)
$(error .venv was made in another folder (this checkout was moved or renamed since), and its \
	commands run $(venv_python), which is gone: `rm -rf .venv`, then make again)
endif

.PHONY: help setup train export quantize report serve test test-slow check docker docker-gpu docker-model docker-smoke bench-train bench-serve clean clean-runs

help: ## list the targets
	@echo "make train export quantize   # the main job (RUN=$(RUN), CONFIG=$(CONFIG))"
	@echo "make test                    # the test suite"
	@echo
	@grep -hE '^[a-z-]+:.*## ' $(call q,$(strip $(MAKEFILE_LIST))) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'
	@echo
	@echo "variables:"
	@echo "  RUN=runs/NAME                 the run directory every target reads and writes (docker-smoke: only when given)"
	@echo "  CONFIG=configs/X.yaml         the training config (train, and a stage that trains first)"
	@echo "                                a stage trains a RUN without best.ckpt only when RUN is $(DEFAULT_RUN),"
	@echo "                                CONFIG or ARGS is given to make, train is among the targets, or RUN"
	@echo "                                trained before (it resumes from checkpoints/last.ckpt)"
	@echo "  RESUME=1                      train: continue from last.ckpt with the run's config.yaml"
	@echo "  ARGS='--set trainer.max_epochs=3'   train, bench-train (and training a stage starts)"
	@echo "  EXPORT_ARGS='--formats onnx'  export (and the export quantize/report/serve start)"
	@echo "  QUANTIZE_ARGS='--methods static'    quantize"
	@echo "  REPORT_ARGS='--rounds 5'      report, and the report \`make quantize\` writes"
	@echo "  SERVE_ARGS='--port 9000'      serve"
	@echo "  IMAGE=lightship-serve         docker, docker-gpu: the image's name (tag VERSION from pyproject.toml);"
	@echo "                                docker-model: tagged with RUN's name"
	@echo "  BENCH_SERVE_ARGS='--duration 2 --rounds 1'   bench-serve (\`lightship bench serve --help\`)"
	@echo "  TORCH='torch==2.13.0'         setup: the torch requirement, installed first; where the plain pin"
	@echo "                                pulls a CUDA build, add --index-url https://download.pytorch.org/whl/cpu"
	@echo "  PYTHON=python3.11             setup: the interpreter .venv is made with (default: python3.11, else python3)"

# TORCH and PYTHON make .venv: given once it exists, they would change nothing without a word
# (the moment to give TORCH is after the first setup pulled a CUDA build).
$(foreach v,TORCH PYTHON,$(if $(and $(filter command line,$(origin $(v))),$(wildcard \
	$(STAMP))),$(warning note: .venv exists, so $(v) changes nothing: `rm -rf .venv`, then \
	make $(here)setup $(v)=$(call q,$(value $(v))))))

# Re-installs only when pyproject.toml changes. torch goes first: the pinned CPU wheel lies on
# this machine, while an unpinned torch requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo ".venv's Python is \
	$$($(PY) -V 2>&1), and lightship needs 3.11 or newer: \`rm -rf .venv\`, then make again \
	(PYTHON=python3.11 names the interpreter)"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[train,serve,dev]'
	@touch $@

setup: $(STAMP) ## create .venv and install lightship with all extras

# ARGS goes to training only: a stage's own flags go in its *_ARGS. Said, not silently dropped,
# unless `train` is among the goals (`make train export quantize ARGS=...`): then it plainly is.
args_note = $(if $(and $(ARGS),$(if $(filter train,$(MAKECMDGOALS)),,1)),$(warning note: ARGS is passed to training only (train, bench-train, or \
	the training this target starts when best.ckpt is missing): $(1) takes $(2)='...'))

# Training's flags: anew with CONFIG, or, when $(1) is 1 (yes, true), resumed with the run's own
# config.yaml unless CONFIG is given on make's command line (one left in the shell's environment
# under that generic name is not the run's: as `train_asked` reads it).
train_flags = $(if $(filter 1 yes true,$(1)),$(if $(filter command line,$(origin CONFIG)),--config $(CONFIG)) --resume,--config $(CONFIG))

# A stage killed outright (SIGKILL, exit 137) cannot say why: most often the kernel's
# out-of-memory killer. make says so, with the stage's own fix ($(2), $(3)), and still fails.
killed = || { rc=$$?; if [ $$rc -eq 137 ]; then echo "make: lightship $(1) was killed (SIGKILL), \
	most often by the out-of-memory killer (\`dmesg | grep -i oom\` or a container's OOMKilled \
	status says): give it more memory$(2), then make again$(3)" >&2; fi; exit $$rc; }
smaller_batch = or train with a smaller data.batch_size (ARGS='--set data.batch_size=32')

train: $(STAMP) ## train CONFIG into RUN (RESUME=1 continues from last.ckpt)
	$(BIN)/lightship train --run $(RUN) $(call train_flags,$(RESUME)) $(ARGS) $(call \
	killed,train, $(smaller_batch), (RESUME=1 goes on from its last saved epoch))

# A later stage builds what it needs when it is missing, so every stage target works on a fresh
# clone: export trains first; quantize, report and serve train and export first (report then
# measures the fp32 variants only, serve serves ONNX fp32). Only a missing file is rebuilt, never
# one that merely looks older: `cp -r` does not keep file times, and re-exporting a copied run
# would delete its int8 models and report. Training keeps the run consistent itself: a new
# best.ckpt deletes every file made from the old one (export/model.onnx included) before it is
# put in place, so a missing model.onnx is the signal to export. A run that trained before
# (checkpoints/last.ckpt) resumes with its own config.yaml: that puts its best checkpoint back
# and keeps what was made from it, where CONFIG's model would replace it.
# A run that is not there is trained only when that is plainly what was asked: the default run
# (a fresh clone's `make serve`), CONFIG or ARGS given on make's command line (not left in the
# shell's environment under those generic names), or `train` among the goals. A mistyped
# RUN (`make export RUN=runs/shapez`) would otherwise train CONFIG's model for minutes and
# export and serve it under the wrong name. Checked as the recipe is expanded, so `make -n`
# stops too.
$(RUN)/best.ckpt: | $(STAMP)
	$(if $(train_asked),,$(error $(no_run)))
	LIGHTSHIP_MAKE_THEN=export $(BIN)/lightship train --run $(RUN) $(call train_flags,$(if $(wildcard $(RUN)/checkpoints/last.ckpt),1)) $(ARGS) \
	$(call killed,train, $(smaller_batch))

comma := ,
empty :=
space := $(empty) $(empty)
train_asked = $(or $(filter train,$(MAKECMDGOALS)),$(filter $(abspath $(DEFAULT_RUN)),$(abspath \
	$(RUN))),$(filter command line,$(origin CONFIG)),$(if $(filter command line,$(origin \
	ARGS)),$(ARGS)),$(wildcard $(RUN)/checkpoints/last.ckpt))
runs_parent = $(dir $(patsubst %/,%,$(RUN)))
trained_runs = $(patsubst $(runs_parent)%/best.ckpt,%,$(wildcard $(runs_parent)*/best.ckpt))
no_run = no trained run at $(RUN): train it first with `make $(here)train RUN=$(RUN) \
	CONFIG=configs/...` (or check the name: $(runs_parent) $(if $(trained_runs),holds: \
	$(subst $(space),$(comma)$(space),$(strip $(trained_runs))),holds no trained run))

export: $(STAMP) | $(RUN)/best.ckpt ## export RUN/best.ckpt to ONNX, TorchScript and .pt2 (parity-checked)
	$(call args_note,export,EXPORT_ARGS)
	$(BIN)/lightship export --run $(RUN) $(EXPORT_ARGS) $(call killed,export)

$(RUN)/export/model.onnx: | $(RUN)/best.ckpt $(STAMP)
	$(BIN)/lightship export --run $(RUN) $(EXPORT_ARGS) $(call killed,export)

quantize: $(STAMP) | $(RUN)/export/model.onnx ## int8 static/dynamic PTQ + QAT behind the accuracy gate, then the report
	$(call args_note,quantize,QUANTIZE_ARGS)
	LIGHTSHIP_MAKE_GOALS='$(MAKECMDGOALS) report' $(BIN)/lightship quantize --run $(RUN) $(QUANTIZE_ARGS) \
	$(call killed,quantize)
	$(BIN)/lightship report --run $(RUN) $(REPORT_ARGS) $(call killed,report)

report: $(STAMP) | $(RUN)/export/model.onnx ## measure every variant in RUN: report/report.md, report.json, pareto.png
	$(call args_note,report,REPORT_ARGS)
	$(BIN)/lightship report --run $(RUN) $(REPORT_ARGS) $(call killed,report)

serve: $(STAMP) | $(RUN)/export/model.onnx ## serve RUN over HTTP (report's recommended variant; SERVE_ARGS='--port 9000')
	$(call args_note,serve,SERVE_ARGS)
	$(BIN)/lightship serve --run $(RUN) $(SERVE_ARGS) $(call killed,serve)

test: $(STAMP) ## lint, type-check and run the test suite (not the slow tests)
	$(BIN)/ruff check src tests deploy
	$(BIN)/ruff format --check src tests deploy
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile Dockerfile.gpu
	$(BIN)/pytest -m "not slow" --durations=15

test-slow: $(STAMP) ## run only the tests marked slow
	$(BIN)/pytest -m slow

check: $(STAMP) ## ruff (lint + format check), mypy and hadolint
	$(BIN)/ruff check src tests deploy
	$(BIN)/ruff format --check src tests deploy
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile Dockerfile.gpu

# Docker's own answer without a daemon ("Cannot connect to the Docker daemon") does not say
# that the image can be checked here without one.
docker_check = @command -v docker >/dev/null && docker info >/dev/null 2>&1 || { echo "make $@ \
	needs Docker with its daemon running (\`docker info\` says why not). Without Docker, \
	\`make docker-smoke\` replays the CPU image's install and serves from it."; exit 1; }

docker: ## build the CPU serving image IMAGE:VERSION (needs Docker; mount a run at /model)
	$(docker_check)
	docker build -t $(IMAGE):$(VERSION) .

docker-gpu: ## build the GPU serving image IMAGE:VERSION-gpu (CUDA 13, onnxruntime-gpu, TensorRT)
	$(docker_check)
	docker build -f Dockerfile.gpu -t $(IMAGE):$(VERSION)-gpu .

# The run is baked in with its ONNX models, manifest.json and report.json (.dockerignore), so the
# image needs no volume; RUN must have been exported (and quantized, for the int8 variants) here.
# Checked as the Makefile is read, before the prerequisite trains or exports anything.
model_run = $(patsubst ./%,%,$(patsubst %/,%,$(RUN)))
ifneq ($(filter docker-model,$(MAKECMDGOALS)),)
ifeq ($(filter runs/%,$(model_run)),)
$(error docker-model bakes in a run under runs/ (the build context lets in only runs/): copy it \
	there, e.g. `cp -r $(RUN) runs/NAME`, and give RUN=runs/NAME)
endif
endif
docker-model: | $(RUN)/export/model.onnx ## build the CPU serving image with RUN baked in: IMAGE:RUN's name
	$(docker_check)
	docker build --target model --build-arg RUN=$(model_run) -t $(IMAGE):$(notdir $(model_run)) .

# RUN only when given (command line or environment): by default a handmade model whose logits
# are known, so the predictions are checked exactly; a real run's are checked for agreement.
docker-smoke: $(STAMP) ## replay the CPU image's install, serve a handmade model (or RUN when given)
	$(PY) deploy/smoke.py$(if $(filter-out file,$(origin RUN)), --run $(RUN))

bench-train: $(STAMP) ## measure training steps/s for the data-loading choices
	$(BIN)/lightship bench train --config $(CONFIG) $(ARGS)

bench-serve: $(STAMP) ## wrk against a real server (digits + ResNet-18) beside no-model and in-process ceilings
	$(call args_note,bench-serve,BENCH_SERVE_ARGS)
	@command -v wrk >/dev/null || { echo "bench-serve needs wrk: sudo apt-get install -y wrk (Debian/Ubuntu) or brew install wrk"; exit 1; }
	$(BIN)/lightship bench serve $(BENCH_SERVE_ARGS)

# Runs are kept: they hold trained weights and minutes of work. Deleting them is its own target.
clean: ## remove caches (keeps runs/ and .venv; `make clean-runs`, `rm -rf .venv` for those)
	rm -rf .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +

clean-runs: ## delete runs/: every trained run, export, int8 model and report in it
	@test ! -d runs || { echo "deleting runs/:" $$(ls runs); rm -rf runs; }

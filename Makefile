# Everyday commands; `make help` lists them. CI (.ci/run) runs the README's test command, ruff
# and mypy on a clean clone.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python)
export PYTHON
# one command block of README.md, between <!-- NAME --> and <!-- /NAME --> (as .ci/run reads it)
readme_block = sed -n '/<!-- $(1) -->/,/<!-- \/$(1) -->/p' README.md | sed -n '/^```bash$$/,/^```$$/p' | sed '1d;$$d'
# one line of the README's test command, as `.ci/run --phases` names it, with $(PYTHON) for .venv's
readme_phase = cmd=$$(.ci/run --phases | sed -n 's/^$(1)\t//p' | sed 's|\.venv/bin/python|$(PYTHON)|g'); \
	echo "+ $$cmd"; bash -c "$$cmd"

.PHONY: help test slow gpu-aot lint format typecheck docs gpu-check standin bench-peers

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

test: ## the fast tests (everything not marked slow): the README test command's `fast` line
	@$(call readme_phase,fast)

slow: ## the slow, end-to-end tests: the README test command's `slow` line
	@$(call readme_phase,slow)

gpu-aot: ## the deviceless XLA:GPU compile tests (.venv-aot): the README test command's last line
	BASE_VENV=$(dir $(PYTHON)).. experiments/gpu/aot_tests.sh

lint: ## ruff format --check, ruff check and the import layers (lint-imports), as CI runs them
	$(PYTHON) -m ruff format --check . && $(PYTHON) -m ruff check . && \
	  $(PYTHON) -c 'import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())'

format: ## ruff format and ruff check --fix
	$(PYTHON) -m ruff format . && $(PYTHON) -m ruff check --fix .

typecheck: ## mypy, configured in pyproject.toml
	$(PYTHON) -m mypy

docs: ## the documentation site, built strictly into site/
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

bench-peers: ## TRL, Tunix and hybridjax on the peer workloads; the ratio table in results/<time>/table.md
	$(PYTHON) -m experiments.benchmarks.run --config=experiments/configs/bench_peers.py

gpu-check: ## the GPU check on a CUDA machine (experiments/gpu/check.sh)
	experiments/gpu/check.sh

standin: ## the GPU check's CPU stand-in: the README's gpu-standin command
	@cmd=$$($(call readme_block,gpu-standin)); \
	if [ -z "$$cmd" ]; then echo "README.md has no gpu-standin command" >&2; exit 2; fi; \
	echo "+ $$cmd"; bash -c "$$cmd"

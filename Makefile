# One command each: `make test` (set-up + the test suite), `make demo` (set-up + the TreeLSTM
# demo), `make bench` (set-up incl. DyNet + the benchmark). Set-up pins torch==2.13.0 first
# (a CPU build here); the project itself allows torch>=2.2.
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check
PYTEST = $(PY) -m pytest

.PHONY: setup setup-bench test test-fast lint typecheck bench bench-quick bench-gpu demo size clean

setup:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"

setup-bench: setup
	$(PIP) -e ".[bench]"

test: setup
	$(PYTEST) -q -p no:cacheprovider

test-fast: setup
	$(PYTEST) -q -p no:cacheprovider -m "not slow" -x

lint:
	$(PY) -m ruff check acrobat acrobat_kernels models bench tests
	$(PY) -m mypy acrobat

bench: setup-bench
	$(PY) -m bench.run --models treelstm,mvrnn,birnn --sizes small,large --batches 8,64 --reps 10 --out bench/results/latest

bench-quick: setup
	$(PY) -m bench.run --quick --out bench/results/quick

# On a machine with a CUDA device, torch built for it, cupy and greenlet (no set-up: the
# pinned CPU torch would replace the CUDA one): the GPU tests, then the benchmark there.
bench-gpu:
	bash bench/gpu.sh bench/results/gpu 600 --sizes small,large --batches 8,64 --reps 3

demo: setup
	$(PY) -m bench.demo

size:
	@echo "core runtime (acrobat/): $$(cat acrobat/*.py | grep -cvE '^\s*(#|$$)') non-blank, non-comment lines"

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis bench/results

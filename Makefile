# Everything runs from a project-local virtual environment, created on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-gpu lint proto bench clean

# What the demo needs: the package and its dependencies (and, on a GPU machine, the CUDA
# engine's stack). Progress is shown: pip's own progress bars, one line per step.
$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) (first run only)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	@echo "==> installing epd and its dependencies"
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	@# On a machine with an NVIDIA GPU, the CUDA engine's stack too (the demo then runs on it).
	@if nvidia-smi -L >/dev/null 2>&1; then echo "==> GPU found: installing the [cuda] extra"; \
	    $(BIN)/pip install --progress-bar on -e '.[cuda]' || \
	    echo "the [cuda] extra did not install: the demo will use the CPU backend"; fi
	touch $(STAMP)

# torch is optional (DeepEP-style torch tensors): only the test suite wants it (its torch tests
# skip without it), so only `make test` installs it, and says so.
TORCH_STAMP := $(VENV)/.torch
$(TORCH_STAMP): | $(STAMP)
	@echo "==> installing torch (optional, for the torch tests of make test; ~1 GB, a minute or two)"
	$(BIN)/pip install --progress-bar on 'torch==2.13.0' || \
	    echo "torch not installed: torch tests will be skipped"
	touch $(TORCH_STAMP)

demo: $(STAMP)  ## daemon + 4 client processes doing dispatch/combine, verified
	$(BIN)/epd demo

bench: $(STAMP) $(TORCH_STAMP)  ## epd bench: EPD through its DeepEP facade beside DeepEP and NCCL (GPU)
	$(BIN)/epd bench

# promtool checks deploy/prometheus/ in the tests: taken from Debian's prometheus package (the
# binary only, unpacked into the venv; no service is installed). Best effort: without apt the
# two promtool tests skip and say so.
$(BIN)/promtool: | $(STAMP)
	@command -v apt-get >/dev/null && tmp=$$(mktemp -d) && \
	  { (cd $$tmp && apt-get download -q prometheus >/dev/null 2>&1) || \
	    { apt-get update -qq >/dev/null 2>&1 && (cd $$tmp && apt-get download -q prometheus >/dev/null); }; } && \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/x && cp $$tmp/x/usr/bin/promtool $(BIN)/promtool; \
	  rm -rf $$tmp; test -x $(BIN)/promtool || echo "promtool not installed: its two tests will skip"

test: $(STAMP) $(TORCH_STAMP) $(BIN)/promtool  ## the CPU test suite (what CI runs)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-gpu: $(STAMP)  ## GPU tests (on a machine with NVIDIA GPUs and the [cuda] extra)
	$(BIN)/python -m pytest -q -m gpu tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check .

proto: $(STAMP)  ## regenerate proto/v1/*_pb2*.py after editing proto/v1/epd.proto
	$(BIN)/python -m epd.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis

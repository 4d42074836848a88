# Everything runs from a project-local virtual environment, created on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-gpu lint proto bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@# torch is optional (DeepEP-style torch tensors); its tests skip without it.
	$(BIN)/pip install -q 'torch==2.13.0' || echo "torch not installed: torch tests will be skipped"
	@# On a machine with an NVIDIA GPU, the CUDA engine's stack too (the demo then runs on it).
	if nvidia-smi -L >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[cuda]' || \
	    echo "the [cuda] extra did not install: the demo will use the CPU backend"; fi
	touch $(STAMP)

demo: $(STAMP)  ## daemon + 4 client processes doing dispatch/combine, verified
	$(BIN)/epd demo

# promtool checks deploy/prometheus/ in the tests: taken from Debian's prometheus package (the
# binary only, unpacked into the venv; no service is installed). Best effort: without apt the
# two promtool tests skip and say so.
$(BIN)/promtool: | $(STAMP)
	@command -v apt-get >/dev/null && tmp=$$(mktemp -d) && \
	  { (cd $$tmp && apt-get download -q prometheus >/dev/null 2>&1) || \
	    { apt-get update -qq >/dev/null 2>&1 && (cd $$tmp && apt-get download -q prometheus >/dev/null); }; } && \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/x && cp $$tmp/x/usr/bin/promtool $(BIN)/promtool; \
	  rm -rf $$tmp; test -x $(BIN)/promtool || echo "promtool not installed: its two tests will skip"

test: $(STAMP) $(BIN)/promtool  ## the CPU test suite (what CI runs)
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

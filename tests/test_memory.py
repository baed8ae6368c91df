"""Memory by part: what `kvbank plan` predicts from metadata is what the loaded engine holds."""

import json
import re
import subprocess
import sys

import pytest
from serving import request, start_server, stop_server, wait_healthy
from tiny_models import smollm2_135m

from kvbank import LLM, memory
from kvbank.config import EngineConfig
from kvbank.kernels import native

# SmolLM2-135M: 49,152 x 576 embedding table tied to the LM head; 30 layers, 3 KV heads of 64 dims.
SMOL = smollm2_135m()
EMBEDDING_BYTES = SMOL.vocab_size * SMOL.hidden_size * 2
# With packed weights the table stays the GGUF's Q8_0 blocks (34 bytes per 32), the LM head reading the same bytes.
Q8_EMBEDDING_BYTES = SMOL.vocab_size * SMOL.hidden_size // 32 * 34
# A KIVI residual slot (int4 KV): K and V of one 16-token block in bfloat16, in every layer.
RESIDUAL_BYTES_PER_SLOT = SMOL.num_layers * 2 * 16 * SMOL.num_kv_heads * SMOL.head_dim * 2
SMALL_POOL = {"kv_cache_memory_gb": 0.05, "max_num_seqs": 4}


@pytest.mark.parametrize(
    "options", [{"weight_format": "dense"}, {"kv_cache_dtype": "int4"}], ids=["dense-weights", "int4-kv"]
)
def test_prediction_equals_the_loaded_engines_tensors(options):
    predicted = memory.predict(EngineConfig(**SMALL_POOL, **options))
    engine = LLM(**SMALL_POOL, **options).engine
    measured = engine.memory
    assert predicted.parts() == measured.parts()
    assert measured.tied_embeddings and measured.lm_head == 0
    dense = options.get("weight_format") == "dense"
    assert measured.embeddings == (EMBEDDING_BYTES if dense or native() is None else Q8_EMBEDDING_BYTES)
    assert measured.kv_pool == engine.num_blocks * engine.pool_plan.bytes_per_block
    if dense:
        assert measured.packed_weights == 0 and measured.residual_slots == 0
    else:
        assert measured.packed_weights > 0
        assert measured.residual_slots == SMALL_POOL["max_num_seqs"] * RESIDUAL_BYTES_PER_SLOT


@pytest.mark.slow
def test_server_log_and_metrics_show_the_memory_plan_predicted(kvbank_env, tmp_path):
    flags = ["--kv-cache-memory-gb", "0.05", "--max-num-seqs", "4"]
    log = tmp_path / "serve.log"
    process, url = start_server(flags, kvbank_env, log)
    try:
        plan = subprocess.run(
            [sys.executable, "-m", "kvbank", "plan", "--json", *flags],
            env=kvbank_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        wait_healthy(process, url, log)
        status, page, _ = request(f"{url}/metrics")
        _, models, _ = request(f"{url}/v1/models")
    finally:
        stop_server(process)
    assert status == 200
    predicted = json.loads(plan.stdout)["memory"]
    gauges = {
        part: int(value) for part, value in re.findall(r'^kvbank:memory_bytes\{part="(\w+)"\} (\d+)$', page, re.M)
    }
    assert gauges == {part: predicted[part] for part in memory.PARTS}
    assert gauges["packed_weights"] > 0
    assert gauges["embeddings"] == (EMBEDDING_BYTES if native() is None else Q8_EMBEDDING_BYTES)
    # Loading holds every weight in float32 at once: the peak is measured, and plan's sum of what
    # the loader holds is within a fifth of it.
    load_peak = int(re.search(r"^kvbank:load_peak_bytes (\d+)$", page, re.M).group(1))
    assert abs(load_peak - predicted["load_peak"]) < 0.2 * predicted["load_peak"]
    assert "memory: weights  packed 63.3 MiB" in log.read_text()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"

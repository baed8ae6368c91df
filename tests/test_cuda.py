"""The same engine on CUDA (skipped where no GPU is present)."""

import pytest
import torch

from kvbank import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_greedy_matches_cpu_float32():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in LLM(dtype="float32", device="cpu").generate(prompts, params)]
    gpu_llm = LLM(dtype="float32", device="cuda")
    gpu = [o.outputs[0].token_ids for o in gpu_llm.generate(prompts, params)]
    agree = sum(a == b for x, y in zip(cpu, gpu) for a, b in zip(x, y)) / sum(map(len, cpu))
    assert agree > 0.9
    assert gpu_llm.engine.manager.num_free_blocks == gpu_llm.engine.num_blocks


def test_cuda_bfloat16_batch_with_prefix_cache_and_sampling():
    llm = LLM(device="cuda")
    system = [{"role": "system", "content": "You are terse."}]
    outs = llm.chat(
        [system + [{"role": "user", "content": f"Count to {i}."}] for i in range(8)],
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, n=2),
    )
    assert all(len(o.outputs) == 2 and o.outputs[0].token_ids for o in outs)
    assert llm.stats()["prefix_cache_hits"] > 0

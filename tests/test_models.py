"""kvbank's folder loader and Llama-family model against Hugging Face on random tiny checkpoints."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_hf_config  # noqa: E402

from kvbank import LLM, SamplingParams  # noqa: E402

# Every case's changes to tiny_models' tiny decoder; CASES adds each one's heads and embedding tying.
TINY = dict(vocab_size=320, max_position_embeddings=256, initializer_range=0.25)

CASES = {
    "llama-gqa-tied": (
        transformers.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama-mha-untied": (
        transformers.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    ),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-gqa": (
        transformers.MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    ),
    "qwen2-bias-tied": (
        transformers.Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3-qknorm-mha": (
        transformers.Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    ),
}

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [100 + i for i in range(37)], [12]]


def _save_random_checkpoint(name: str, folder) -> torch.nn.Module:
    config_cls, extra = CASES[name]
    torch.manual_seed(hash(name) % 1000)
    config = tiny_hf_config(config_cls, **TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # q/k/v biases start at zero; make them matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return model


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", sorted(CASES))
def test_random_checkpoint_matches_transformers(name, tmp_path):
    hf_model = _save_random_checkpoint(name, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_gpu_blocks=64, block_size=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(hf_model, prompt, 16), f"{name}: prompt {prompt[:4]}"
    assert llm.engine.manager.num_free_blocks == 64


def test_folder_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_unsupported_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="gpt2"):
        LLM(str(tmp_path))


def test_missing_path_and_unknown_format_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))
    weird = tmp_path / "model.bin"
    weird.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither"):
        LLM(str(weird))


def test_loading_progress_off_a_terminal_is_a_few_plain_lines(capfd):
    from kvbank.models.loader import load_model

    calls = []
    load_model(None, progress=lambda done, total: calls.append(done))  # pytest's stderr is no terminal
    lines = capfd.readouterr().err.splitlines()
    assert calls == []  # a bar redrawn with carriage returns would be one huge line in a log
    assert [line.split("(")[-1] for line in lines] == ["25%)", "50%)", "75%)", "100%)"]
    assert "\r" not in "".join(lines)

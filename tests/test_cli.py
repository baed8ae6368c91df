"""The `kvbank` command line, run as real `python -m kvbank` processes."""
import re
import subprocess
import sys

BLOCK_SIZE = 16
STATUS = re.compile(r"\[cached (\d+)/(\d+) prompt tokens, TTFT (\d+) ms\]")


def _kvbank(env: dict, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbank", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=120)


def test_generate_prints_the_completion_and_a_progress_bar(kvbank_env):
    result = _kvbank(kvbank_env, "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Loading model" in result.stderr


def test_bad_sampling_flag_is_a_clear_error_before_loading(kvbank_env):
    result = _kvbank(kvbank_env, "generate", "Hi", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature=-1.0" in result.stderr
    assert "Loading model" not in result.stderr


def test_chat_second_turn_reuses_the_first_turns_cache(kvbank_env):
    # A story outlasts --max-tokens, so the first reply has exactly that many tokens.
    max_tokens = 12
    result = _kvbank(kvbank_env, "chat", "--max-tokens", str(max_tokens), "--temperature", "0", "--dtype", "float32",
                     stdin="Write a long story about a dragon.\nMake it shorter.\n")
    assert result.returncode == 0, result.stderr
    replies = [text.strip() for text in STATUS.split(result.stdout)[::4][:-1]]
    statuses = [tuple(map(int, match)) for match in STATUS.findall(result.stdout)]
    assert len(statuses) == 2 and all(replies), result.stdout
    (cached_1, prompt_1, _), (cached_2, prompt_2, _) = statuses
    assert cached_1 == 0
    # Turn 2 continues turn 1's tokens, so all of turn 1's prompt and reply is cached but the
    # partly filled last block (the reply's last token was never fed back, so its KV is unwritten).
    assert prompt_2 > prompt_1 + max_tokens
    assert cached_2 >= prompt_1 + max_tokens - BLOCK_SIZE


def test_kv_cache_flags_reach_the_engine(kvbank_env):
    result = _kvbank(kvbank_env, "generate", "The capital of France is", "--max-tokens", "4", "--temperature", "0",
                     "--kv-cache-dtype", "int4", "--kv-cache-dtype-skip-layers", "0,-1", "--num-gpu-blocks", "64")
    assert result.returncode == 0, result.stderr
    # 28 int4 layers (88 bytes per KV head) and 2 bfloat16 layers (256), 3 KV heads each
    assert "KV cache: 64 blocks of 16 tokens, int4, 8928 bytes per token" in result.stderr
    assert result.stdout.strip()


def test_bad_kv_cache_dtype_is_refused_by_every_command(kvbank_env):
    for command in ("generate", "serve", "chat"):
        args = [command, "Hi"] if command == "generate" else [command]
        result = _kvbank(kvbank_env, *args, "--kv-cache-dtype", "int3")
        assert result.returncode == 2
        assert "invalid choice: 'int3'" in result.stderr and "int4" in result.stderr

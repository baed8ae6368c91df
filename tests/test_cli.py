"""The `kvbank` command line: real `python -m kvbank` processes, and its flags parsed in process."""

import dataclasses
import json
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import free_port

from kvbank import LLM, __version__, cli, flags, kernels
from kvbank.config import EngineConfig
from kvbank.defaults import CLI_MAX_TOKENS
from kvbank.engine.params import SamplingParams
from kvbank.server.limits import ServerLimits

BLOCK_SIZE = 16
STATUS = re.compile(r"\[cached (\d+)/(\d+) prompt tokens, TTFT (\d+) ms\]")


def _kvbank(env: dict, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbank", *args], input=stdin, capture_output=True, text=True, env=env, timeout=120
    )


@dataclasses.dataclass(frozen=True)
class Run:
    """One `python -m kvbank` process: its arguments and what it reads from stdin."""

    args: tuple[str, ...]
    stdin: str | None = None


GENERATE = Run(
    ("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--dtype", "float32")
)
BAD_SAMPLING_FLAG = Run(("generate", "Hi", "--temperature", "-1"))
# A story outlasts --max-tokens, so the first reply has exactly that many tokens.
CHAT_MAX_TOKENS = 12
CHAT_TWO_TURNS = Run(
    ("chat", "--max-tokens", str(CHAT_MAX_TOKENS), "--temperature", "0", "--dtype", "float32"),
    stdin="Write a long story about a dragon.\nMake it shorter.\n",
)
SINK_WINDOW_TURNS = [f"Tell me about the number {n} and why it matters in {n} ways." for n in range(1, 7)]
CHAT_PAST_THE_CONTEXT = Run(
    (
        "chat",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "64",
        "--kv-policy",
        "sink_window(sinks=4,window=96)",
        "--max-tokens",
        "40",
        "--temperature",
        "0",
    ),
    stdin="\n".join(SINK_WINDOW_TURNS) + "\n",
)
KV_CACHE_FLAGS = Run(
    (
        "generate",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--kv-cache-dtype",
        "int4",
        "--kv-cache-dtype-skip-layers",
        "0,-1",
        "--num-gpu-blocks",
        "64",
    )
)
BAD_KV_CACHE_DTYPE = [
    Run((*([command, "Hi"] if command == "generate" else [command]), "--kv-cache-dtype", "int3"))
    for command in ("generate", "serve", "chat")
]
VERSION = Run(("--version",))
ABBREVIATED_FLAG = Run(("serve", "--max-tokens", "64"))  # a prefix of --max-tokens-cap
UNKNOWN_FLAG = Run(("generate", "Hi", "--no-such-flag"))
PROCESSES = [
    GENERATE,
    BAD_SAMPLING_FLAG,
    CHAT_TWO_TURNS,
    CHAT_PAST_THE_CONTEXT,
    KV_CACHE_FLAGS,
    *BAD_KV_CACHE_DTYPE,
    VERSION,
    ABBREVIATED_FLAG,
    UNKNOWN_FLAG,
]


@pytest.fixture(scope="module")
def kvbank(kvbank_env):
    """The finished process of a Run in PROCESSES. All of them start with the first test that asks,
    two at a time: each runs on one core (kvbank_env) and would otherwise leave the other idle."""
    kernels.native()  # built (or loaded) here, with no timeout, so that the processes only load it
    pool = ThreadPoolExecutor(max_workers=2)
    started = {run: pool.submit(_kvbank, kvbank_env, *run.args, stdin=run.stdin) for run in PROCESSES}
    yield lambda run: started[run].result()
    pool.shutdown(cancel_futures=True)


def test_generate_prints_the_completion_and_plain_progress_lines_in_a_log(kvbank):
    result = kvbank(GENERATE)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    progress = [line for line in result.stderr.splitlines() if line.startswith("kvbank: loading the model: ")]
    assert len(progress) == 4 and progress[-1].endswith("(100%)"), result.stderr
    assert "\r" not in result.stderr


def test_bad_sampling_flag_is_a_clear_error_before_loading(kvbank):
    result = kvbank(BAD_SAMPLING_FLAG)
    assert result.returncode == 2
    assert "temperature=-1.0" in result.stderr
    assert "loading the model" not in result.stderr


def test_chat_second_turn_reuses_the_first_turns_cache(kvbank):
    result = kvbank(CHAT_TWO_TURNS)
    assert result.returncode == 0, result.stderr
    replies = [text.strip() for text in STATUS.split(result.stdout)[::4][:-1]]
    statuses = [tuple(map(int, match)) for match in STATUS.findall(result.stdout)]
    assert len(statuses) == 2 and all(replies), result.stdout
    (cached_1, prompt_1, _), (cached_2, prompt_2, _) = statuses
    assert cached_1 == 0
    # Turn 2 continues turn 1's tokens, so all of turn 1's prompt and reply is cached but the
    # partly filled last block (the reply's last token was never fed back, so its KV is unwritten).
    assert prompt_2 > prompt_1 + CHAT_MAX_TOKENS
    assert cached_2 >= prompt_1 + CHAT_MAX_TOKENS - BLOCK_SIZE


def test_chat_keeps_going_past_the_context_with_sink_window(kvbank):
    result = kvbank(CHAT_PAST_THE_CONTEXT)
    assert result.returncode == 0, result.stderr
    statuses = [tuple(map(int, match)) for match in STATUS.findall(result.stdout)]
    assert len(statuses) == len(SINK_WINDOW_TURNS), result.stdout
    # The conversation outgrows the 256-token context and every turn still gets its reply.
    assert statuses[-1][1] > 256 + 40, statuses


def test_kv_cache_flags_reach_the_engine(kvbank):
    result = kvbank(KV_CACHE_FLAGS)
    assert result.returncode == 0, result.stderr
    # 28 int4 layers (71.375 bytes per KV head) and 2 bfloat16 layers (256), 3 KV heads each: 7531.5
    assert "KV cache: 64 blocks of 16 tokens, int4, 7532 bytes per token" in result.stderr
    assert result.stdout.strip()


def test_bad_kv_cache_dtype_is_refused_by_every_command(kvbank):
    for run in BAD_KV_CACHE_DTYPE:
        result = kvbank(run)
        assert result.returncode == 2
        assert "invalid choice: 'int3'" in result.stderr and "int4" in result.stderr


def test_a_bad_flag_prints_the_commands_usage_line_and_the_error_only(kvbank):
    for run in [*BAD_KV_CACHE_DTYPE, UNKNOWN_FLAG]:
        command = run.args[0]
        usage, error = kvbank(run).stderr.splitlines()
        assert usage.startswith(f"usage: kvbank {command} [-h] ...") and f"kvbank {command} --help" in usage
        assert error.startswith(f"kvbank {command}: error: ")
    assert "unrecognized arguments: --no-such-flag" in kvbank(UNKNOWN_FLAG).stderr


def test_a_prefix_of_a_flag_is_not_taken_for_it(kvbank):
    result = kvbank(ABBREVIATED_FLAG)
    assert result.returncode == 2 and "unrecognized arguments: --max-tokens 64" in result.stderr
    parser = cli.build_parser()
    for args in (["serve", "--kv-cache-memory", "2"], ["plan", "--memory", "1"], ["chat", "--temp", "0"]):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(args)
        assert exited.value.code == 2


def test_version_prints_the_package_version(kvbank):
    result = kvbank(VERSION)
    assert result.returncode == 0 and result.stdout == f"kvbank {__version__}\n"


def test_a_port_in_use_is_an_error_before_the_model_loads(kvbank_env):
    with socket.create_server(("127.0.0.1", free_port())) as taken:
        port = taken.getsockname()[1]
        result = _kvbank(kvbank_env, "serve", "--port", str(port))
    assert result.returncode == 2
    assert f"kvbank: error: cannot listen on 127.0.0.1:{port}: " in result.stderr and "--port" in result.stderr
    assert "loading the model" not in result.stderr and "serving" not in result.stdout


def test_api_keys_come_from_repeated_flags_or_a_files_lines_and_the_environment_gives_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBANK_API_KEY", "sk-env")
    parser = cli.build_parser()  # the environment's key is the flag's default
    assert parser.parse_args(["serve"]).api_key == "sk-env"
    flags = ["serve", "--api-key", "sk-a", "--api-key", "sk-b"]
    assert parser.parse_args(flags).api_key == ["sk-a", "sk-b"], "the flags replace the environment's key"
    monkeypatch.delenv("KVBANK_API_KEY")
    keys = tmp_path / "keys"
    keys.write_text("sk-a\n\n  sk-b  \r\n")
    args = cli.build_parser().parse_args(["serve", "--api-key-file", str(keys)])
    limits = ServerLimits(**{name: getattr(args, name) for name in cli._limit_options()})
    assert limits.api_keys() == ("sk-a", "sk-b")


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--api-key", "sk-same", "--api-key", "sk-same"], "api_key 1 and 2 of 2 are the same key: give each once"),
        (["--api-key", "sk-one", "--api-key", " "], "api_key 2 of 2 is empty"),
        (["--api-key-file", "{keys}"], "api_key 1 and 3 of 3 are the same key"),
    ],
)
def test_a_repeated_or_empty_api_key_is_refused_at_startup_without_showing_a_key(
    flags, problem, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("KVBANK_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("sk-same\nsk-other\nsk-same\n")
    assert cli.main(["serve", *(flag.format(keys=keys) for flag in flags)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"kvbank: error: {problem}")
    assert error.count("\n") == 1 and "sk-" not in error, "one line, naming no key"


# --- options generated from EngineConfig and SamplingParams --------------------------------------


def test_every_sampling_param_is_a_flag_or_says_why_not():
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert fields == set(flags.SAMPLING_HELP) | set(flags.SAMPLING_NOT_ON_CLI)


def test_sampling_flags_become_the_sampling_params():
    args = cli.build_parser().parse_args(
        [
            "generate",
            "Hi",
            "--temperature",
            "0.5",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--min-p",
            "0.1",
            "--presence-penalty",
            "0.5",
            "--frequency-penalty",
            "-0.5",
            "--repetition-penalty",
            "1.1",
            "--max-tokens",
            "7",
            "--min-tokens",
            "2",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-ids",
            "2,7",
            "--include-stop-str-in-output",
            "--ignore-eos",
            "--no-skip-special-tokens",
        ]
    )
    assert cli._sampling_params(args) == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        max_tokens=7,
        min_tokens=2,
        stop=["a", "b"],
        stop_token_ids=[2, 7],
        include_stop_str_in_output=True,
        ignore_eos=True,
        skip_special_tokens=False,
    )
    defaults = cli._sampling_params(cli.build_parser().parse_args(["chat"]))
    assert defaults == SamplingParams(max_tokens=CLI_MAX_TOKENS)


def test_every_engine_option_is_a_flag_of_every_engine_command():
    parser = cli.build_parser()
    for command in (["generate", "Hi"], ["chat"], ["serve"]):
        args = parser.parse_args([*command, "--no-enable-prefix-caching", "--kv-cache-dtype-skip-layers", "0,-1"])
        config = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
        assert config == {
            **_defaults(EngineConfig),
            "enable_prefix_caching": False,
            "kv_cache_dtype_skip_layers": (0, -1),
        }


def test_plan_takes_the_options_that_change_its_numbers():
    args = cli.build_parser().parse_args(
        [
            "plan",
            "--memory-gb",
            "0.5",
            "--weight-format",
            "dense",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "int4",
            "--max-model-len",
            "1024",
            "--num-gpu-blocks",
            "8",
            "--device",
            "cpu",
        ]
    )
    assert (
        args.kv_cache_memory_gb,
        args.weight_format,
        args.dtype,
        args.kv_cache_dtype,
        args.max_model_len,
        args.num_gpu_blocks,
    ) == (0.5, "dense", "float32", "int4", 1024, 8)
    assert not hasattr(args, "seed") and not hasattr(args, "enable_prefix_caching")


def test_llm_names_an_unknown_option_before_loading():
    with pytest.raises(TypeError, match="kv_cache_dtpye"):
        LLM(kv_cache_dtpye="int4")


def test_served_model_name_is_the_model_as_given_like_vllm():
    assert cli.served_model_name(None, "~/models/x.gguf", "/home/u/models/x.gguf") == "~/models/x.gguf"
    assert cli.served_model_name(None, None, "/site/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert cli.served_model_name("mine", "~/models/x.gguf", "/home/u/models/x.gguf") == "mine"


def test_plan_calls_the_model_by_the_name_the_server_serves(capsys):
    assert cli.main(["plan", "--json", "--memory-gb", "0.05"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["name"] == cli.served_model_name(None, None, plan["model"]) == "SmolLM2-135M-Instruct.Q4_1"


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


# --- the flags are honoured ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_gb=0.05, max_num_seqs=4)


def _run(llm, *flags: str, prompt: str = "The capital of France is"):
    args = cli.build_parser().parse_args(["generate", prompt, *flags])
    return llm.generate(prompt, cli._sampling_params(args))[0].outputs[0]


def test_max_tokens_min_tokens_and_stop_token_ids_are_honoured(llm):
    greedy = _run(llm, "--temperature", "0", "--max-tokens", "6", "--ignore-eos")
    assert len(greedy.token_ids) == 6
    third = greedy.token_ids[2]
    stopped = _run(llm, "--temperature", "0", "--stop-token-ids", str(third))
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(third) + 1]
    held = _run(
        llm,
        "--temperature",
        "0",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--stop-token-ids",
        str(third),
        "--min-tokens",
        "5",
    )
    # Until min_tokens, stop tokens cannot even be sampled (as in vLLM).
    assert held.token_ids[:2] == greedy.token_ids[:2] and third not in held.token_ids[:5]


def test_stop_strings_are_honoured(llm):
    greedy = _run(llm, "--temperature", "0", "--max-tokens", "6")
    word = greedy.text.split()[0]
    assert (
        _run(llm, "--temperature", "0", "--max-tokens", "6", "--stop", word).text
        == greedy.text[: greedy.text.index(word)]
    )
    kept = _run(llm, "--temperature", "0", "--max-tokens", "6", "--stop", word, "--include-stop-str-in-output")
    assert kept.text == greedy.text[: greedy.text.index(word) + len(word)]


def test_top_k_of_one_is_greedy(llm):
    greedy = _run(llm, "--temperature", "0", "--max-tokens", "8")
    assert _run(llm, "--temperature", "1.5", "--top-k", "1", "--max-tokens", "8").token_ids == greedy.token_ids


@pytest.mark.slow
def test_seed_makes_sampling_reproducible(capsys):
    def sample(seed: str) -> str:
        assert (
            cli.main(
                [
                    "generate",
                    "Once upon a time",
                    "--max-tokens",
                    "12",
                    "--temperature",
                    "1.5",
                    "--kv-cache-memory-gb",
                    "0.05",
                    "--seed",
                    seed,
                ]
            )
            == 0
        )
        return capsys.readouterr().out

    first = sample("1")
    assert sample("1") == first
    assert sample("2") != first

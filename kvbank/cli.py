"""The `kvbank` command: `generate` one completion, `chat` in the terminal, or `serve` an OpenAI API."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import uvicorn

from kvbank.cache.quant import KV_CACHE_DTYPES
from kvbank.cache.storage import plan_pool
from kvbank.config import EngineConfig
from kvbank.engine.llm import LLM
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.models.loader import describe_model
from kvbank.server.api import ServerLimits, build_app, system_prompt_prefix
from kvbank.server.async_engine import AsyncEngine
from kvbank.tokenizer import Tokenizer

CLI_DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_QUEUED = 512
DEFAULT_MAX_N = 16
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


class ChatSession:
    """A conversation kept as the exact token ids the engine has seen, so each turn extends the last.

    Rendering the whole conversation again and tokenizing it afresh can change earlier tokens
    (replies tokenize differently from how they were generated, and templates may rewrite past
    turns), which would cost prefix-cache hits. Instead, each turn appends only the tokens of the
    text the template adds, so every full KV block of the previous turn is found in the cache.
    """

    def __init__(self, tokenizer: Tokenizer, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.token_ids: list[int] = []
        self.text = ""  # what `token_ids` decode to, special tokens included

    def prompt_for(self, user_text: str) -> list[int]:
        """Add the user's message; return the token ids to generate the assistant's reply from."""
        self.messages.append({"role": "user", "content": user_text})
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if self.token_ids and rendered.startswith(self.text):
            self.token_ids = self.token_ids + self.tokenizer.encode(rendered[len(self.text):],
                                                                    add_special_tokens=False)
        else:
            # First turn, or the template rewrote the past (e.g. dropped a stop string the reply
            # held): the cache still serves whatever prefix the new tokens share.
            self.token_ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        self.text = rendered
        return list(self.token_ids)

    def add_reply(self, output: RequestOutput) -> None:
        """Record the assistant's reply, keeping the ids it was generated as."""
        completion = output.outputs[0]
        self.messages.append({"role": "assistant", "content": completion.text})
        self.token_ids = output.prompt_token_ids + completion.token_ids
        self.text += self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvbank` command line; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.command(args)
    except ValueError as error:
        print(f"kvbank: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# --- the commands --------------------------------------------------------------------------------

def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    output = _print_streamed(llm, args.prompt, params)
    if not output.outputs[0].text.endswith("\n"):
        print()
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    session = ChatSession(llm.get_tokenizer(), args.system_prompt)
    interactive = sys.stdin.isatty()
    print("Type a message; /exit or end of input quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if not line.strip():
            continue
        prompt_ids = session.prompt_for(line)
        output = _print_streamed(llm, prompt_ids, params)
        session.add_reply(output)
        print()
        print(_turn_status(output), flush=True)
    return 0


def _serve(args: argparse.Namespace) -> int:
    missing = [file for file in args.pin_prompt if not Path(file).is_file()]
    if missing:
        raise ValueError(f"--pin-prompt file {missing[0]!r} does not exist")
    limits = ServerLimits(api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                          max_tokens_cap=args.max_tokens_cap, max_n=args.max_n)
    llm = _load(args)
    for file in args.pin_prompt:
        # The file holds a system prompt (its final newline is the editor's, not the prompt's).
        system_prompt = Path(file).read_text().removesuffix("\n")
        pinned = llm.pin_prefix(system_prompt_prefix(llm.get_tokenizer(), system_prompt))
        print(f"kvbank: pinned {pinned} tokens of {file}", flush=True)
    name = args.served_model_name or args.model or Path(llm.engine.model_path).stem
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, name, limits)
    url = f"http://{args.host}:{args.port}"
    print(f"kvbank: model loaded; serving {name!r} with an OpenAI-compatible API at {url}/v1", flush=True)
    print(f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
          flush=True)
    try:
        # uvicorn stops accepting on SIGTERM/SIGINT, lets running requests finish for up to
        # --shutdown-timeout seconds, then cancels them (which aborts them and frees their blocks).
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout)
        _GracefulServer(config).run()
    finally:
        async_engine.shutdown()
    print("kvbank: stopped", flush=True)
    return 0


def _plan(args: argparse.Namespace) -> int:
    info = describe_model(args.model)
    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size,
                          max_num_seqs=args.max_num_seqs, kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
                          kv_quant_group_size=args.kv_quant_group_size)
    dtype = config.torch_dtype
    context = args.context_len or info.config.max_position_embeddings
    budget = int(args.memory_gb * 2**30)
    rows = []
    for kv in KV_CACHE_DTYPES:
        plan = plan_pool(info.config, dtype, budget, args.block_size, kv, config.kv_cache_dtype_skip_layers,
                         config.kv_quant_group_size, reserved_seqs=args.max_num_seqs)
        per_seq = -(-context // args.block_size)
        rows.append({"kv_cache_dtype": kv, "bytes_per_token": plan.bytes_per_token,
                     "residual_bytes_per_seq": plan.residual_bytes_per_seq, "num_blocks": plan.num_blocks,
                     "num_tokens": plan.num_tokens,
                     "sequences": min(args.max_num_seqs, plan.num_blocks // per_seq),
                     "max_sequences": plan.sequences_that_fit(context)})
    full = rows[0]["bytes_per_token"]
    weights = info.num_params * torch.empty(0, dtype=dtype).element_size()
    if args.json:
        print(json.dumps({"model": info.path, "num_params": info.num_params, "file_bytes": info.file_bytes,
                          "weights_bytes": weights, "dtype": str(dtype).removeprefix("torch."),
                          "memory_bytes": budget, "context_len": context, "block_size": args.block_size,
                          "max_num_seqs": args.max_num_seqs, "rows": rows}, indent=1))
        return 0
    print(f"model    {info.config.name}: {info.num_params / 1e6:.1f}M parameters, file {_mib(info.file_bytes)}, "
          f"weights at {str(dtype).removeprefix('torch.')} {_mib(weights)}")
    print(f"KV pool  {_mib(budget)}, blocks of {args.block_size} tokens, context {context} tokens; "
          f"{info.config.num_layers} layers x {info.config.num_kv_heads} KV heads x {info.config.head_dim} dims")
    print(f"{'kv_cache_dtype':<15}{'bytes/token':>12}{'vs auto':>9}{'residual/seq':>14}{'tokens':>11}"
          f"{'seqs':>7}{'max seqs':>10}")
    for row in rows:
        print(f"{row['kv_cache_dtype']:<15}{row['bytes_per_token']:>12.1f}{row['bytes_per_token'] / full:>8.3f}x"
              f"{_mib(row['residual_bytes_per_seq']):>14}{row['num_tokens']:>11}{row['sequences']:>7}"
              f"{row['max_sequences']:>10}")
    print(f"seqs: full-length sequences at --max-num-seqs {args.max_num_seqs} (int4/int2 reserve one residual "
          "block per sequence); max seqs: with --max-num-seqs set to that number")
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class _GracefulServer(uvicorn.Server):
    """uvicorn, except that a stop by SIGTERM/SIGINT ends the process with status 0.

    uvicorn re-raises the signal after its graceful shutdown, so the process would die by it.
    """

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


# --- helpers -------------------------------------------------------------------------------------

def _load(args: argparse.Namespace) -> LLM:
    engine_args = {name: getattr(args, name) for name in _ENGINE_DEFAULTS}
    llm = LLM(**engine_args, show_progress=True)
    engine = llm.engine
    print(f"KV cache: {engine.num_blocks} blocks of {engine.block_size} tokens, {args.kv_cache_dtype}, "
          f"{engine.kv_bytes_per_token:.0f} bytes per token", file=sys.stderr, flush=True)
    return llm


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, stop=args.stop, ignore_eos=args.ignore_eos)


def _print_streamed(llm: LLM, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
    """Print the completion as it is generated; return the final output."""
    printed = 0
    for output in llm.stream(prompt, params):
        text = output.outputs[0].text
        print(text[printed:], end="", flush=True)
        printed = max(printed, len(text))
    return output


def _turn_status(output: RequestOutput) -> str:
    ttft = output.metrics.time_to_first_token
    ttft_text = "n/a" if ttft is None else f"{ttft * 1000:.0f} ms"
    return f"[cached {output.num_cached_tokens}/{len(output.prompt_token_ids)} prompt tokens, TTFT {ttft_text}]"


# --- the parser ----------------------------------------------------------------------------------

def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbank", description="A KV-cache-first LLM inference engine.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    engine, sampling = _engine_flags(), _sampling_flags()

    generate = commands.add_parser("generate", parents=[engine, sampling], help="complete one prompt",
                                   description="Print the completion of PROMPT as it is generated.")
    generate.add_argument("prompt", help="the text to complete")
    _bind(generate, _generate)

    chat = commands.add_parser("chat", parents=[engine, sampling], help="chat in the terminal",
                               description="Multi-turn chat through the model's chat template; each turn "
                                           "reuses the previous turns' KV cache.")
    chat.add_argument("--system-prompt", help="a system message to start the conversation with")
    _bind(chat, _chat)

    serve = commands.add_parser("serve", parents=[engine], help="serve an OpenAI-compatible HTTP API",
                                description="Serve /v1/completions, /v1/chat/completions and /v1/models.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: --model, or the "
                                                   "bundled model's file name)")
    serve.add_argument("--pin-prompt", action="append", default=[], metavar="FILE",
                       help="a system prompt to compute once and keep cached (repeatable): chat requests whose "
                            "system message is this file's text reuse it")
    serve.add_argument("--api-key", default=os.environ.get("KVBANK_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "(default: $KVBANK_API_KEY, else no key)")
    serve.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                       help="requests waiting for a batch slot beyond which new ones get 429 (default: %(default)s)")
    serve.add_argument("--max-tokens-cap", type=int, default=None,
                       help="largest max_tokens a request may ask for; also the default for chat requests "
                            "that name none (default: no cap)")
    serve.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest n a request may ask for "
                                                                      "(default: %(default)s)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let running requests finish before aborting them "
                            "(default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: %(default)s)")
    _bind(serve, _serve)

    plan = commands.add_parser("plan", help="how much KV cache fits in a memory budget",
                               description="For a model, a KV memory budget and a context length: weight bytes, "
                                           "KV bytes per token for every --kv-cache-dtype, and how many tokens and "
                                           "full-length sequences fit. The engine sizes its pool the same way.")
    plan.add_argument("--model", help="a .gguf file or a Hugging Face model folder (default: the bundled model)")
    plan.add_argument("--memory-gb", type=float, default=1.0, help="KV pool budget in GiB (default: %(default)s)")
    plan.add_argument("--context-len", type=int, help="tokens per sequence (default: the model's context length)")
    plan.add_argument("--dtype", default="auto", help="model dtype: auto (bfloat16), bfloat16 or float32")
    d = _ENGINE_DEFAULTS
    plan.add_argument("--block-size", type=int, default=d["block_size"], help="(default: %(default)s)")
    plan.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                      help="sequences the engine reserves int4/int2 residual blocks for (default: %(default)s)")
    plan.add_argument("--kv-cache-dtype-skip-layers", type=_layer_list, default=(), metavar="I,J,...")
    plan.add_argument("--kv-quant-group-size", type=int, default=d["kv_quant_group_size"])
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _bind(plan, _plan)
    return parser


def _bind(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int]) -> None:
    parser.set_defaults(command=command)


def _engine_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("engine")
    d = _ENGINE_DEFAULTS
    group.add_argument("--model", default=d["model"],
                       help="a .gguf file or a Hugging Face model folder (default: bundled SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default=d["dtype"], help="auto (bfloat16), bfloat16, float16 or float32 "
                                                           "(default: %(default)s)")
    group.add_argument("--device", default=d["device"], help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=d["block_size"],
                       help="tokens per KV block (default: %(default)s)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=d["kv_cache_memory_gb"],
                       help="memory for the KV pool in GiB (default: 1)")
    group.add_argument("--num-gpu-blocks", type=int, default=d["num_gpu_blocks"],
                       help="size the KV pool in blocks instead of memory")
    group.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                       help="context limit in tokens (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                       help="most sequences in one batch (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                       help="most tokens in one step (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d["enable_prefix_caching"], help="reuse KV blocks of shared prefixes "
                                                                "(default: on)")
    group.add_argument("--max-pinned-fraction", type=float, default=d["max_pinned_fraction"],
                       help="most of the KV pool pinned prefixes may hold (default: %(default)s)")
    group.add_argument("--weight-format", choices=("auto", "dense", "int4"), default=d["weight_format"],
                       help="auto keeps a GGUF's 4-bit weights 4-bit for small batches in bfloat16 on CPU; "
                            "dense dequantizes everything (default: %(default)s)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d["kv_cache_dtype"],
                       help="how the KV pool stores keys and values; auto is the model dtype (default: %(default)s)")
    group.add_argument("--kv-cache-dtype-skip-layers", type=_layer_list, default=d["kv_cache_dtype_skip_layers"],
                       metavar="I,J,...", help="layers kept in the model dtype, e.g. 0,-1 (default: none)")
    group.add_argument("--kv-quant-group-size", type=int, default=d["kv_quant_group_size"],
                       help="channels sharing one scale in int4/int2 values (default: %(default)s)")
    group.add_argument("--seed", type=int, default=d["seed"], help="random seed (default: %(default)s)")
    return flags


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices") from None


def _sampling_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("sampling")
    d = _SAMPLING_DEFAULTS
    group.add_argument("--max-tokens", type=int, default=CLI_DEFAULT_MAX_TOKENS,
                       help="most tokens to generate (default: %(default)s)")
    group.add_argument("--min-tokens", type=int, default=d["min_tokens"],
                       help="tokens to generate before EOS or a stop may end the reply (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=d["temperature"],
                       help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=d["top_k"], help="0 disables (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=d["min_p"], help="(default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=d["presence_penalty"], help="(default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=d["frequency_penalty"],
                       help="(default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"],
                       help="(default: %(default)s)")
    group.add_argument("--stop", action="append", help="a string that ends the reply (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    return flags

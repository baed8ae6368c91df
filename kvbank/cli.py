"""The `kvbank` command: `generate` one completion, `chat` in the terminal, or `serve` an OpenAI API."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from kvbank import __version__, kernels, memory
from kvbank.cache.hybrid import kv_groups
from kvbank.cache.quant import KV_CACHE_DTYPES
from kvbank.cache.storage import plan_pool
from kvbank.cache.tiers.disk import DIR_MODE
from kvbank.config import EngineConfig
from kvbank.engine.llm import LLM
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.flags import SAMPLING_HELP, Parser, add_config_flag, add_limit_flag, engine_flags, sampling_flags
from kvbank.kernels import isa
from kvbank.models.build import check_supported
from kvbank.models.loader import BUNDLED_FILE, describe_model, model_name
from kvbank.server.api import build_app
from kvbank.server.async_engine import AsyncEngine
from kvbank.server.completions import system_prompt_prefix
from kvbank.server.connections import connection_limit, guarded_protocol
from kvbank.server.limits import ServerLimits
from kvbank.server.worker import spill_to_tiers
from kvbank.tokenizer import Tokenizer

# `kvbank plan` has spelled the pool's size --memory-gb from the start.
_PLAN_ALIASES = {"kv_cache_memory_gb": ("--memory-gb",)}


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
            self.token_ids = self.token_ids + self.tokenizer.encode(
                rendered[len(self.text) :], add_special_tokens=False
            )
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


def run() -> None:
    """The `kvbank` executable: `main`, then exit with its status. Every command has closed what it
    opened by then, so the objects left (torch's, the server's) are frozen rather than collected
    again at exit, which took ~0.5 s of every command's wall time."""
    status = main()
    gc.freeze()
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvbank` command line; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the top-level parser would show its own usage; the command's is the one that helps
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with _startup_log_on_stderr():
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
    with _load(args) as llm:  # closing writes what the tiers' writer still has queued
        output = _print_streamed(llm, args.prompt, params)
    if not output.outputs[0].text.endswith("\n"):
        print()
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    with _load(args) as llm:  # closing writes what the tiers' writer still has queued
        _converse(llm, args, params)
    return 0


def _converse(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> None:
    """The chat loop: a line in, a streamed reply out, until /exit or the end of input."""
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


def _serve(args: argparse.Namespace) -> int:
    if not 0 <= args.drain_grace <= args.shutdown_timeout:
        raise ValueError(
            f"--drain-grace {args.drain_grace:g} must be between 0 and --shutdown-timeout {args.shutdown_timeout:g}"
        )
    missing = [file for file in args.pin_prompt if not Path(file).is_file()]
    if missing:
        raise ValueError(f"--pin-prompt file {missing[0]!r} does not exist")
    limits = ServerLimits(**{name: getattr(args, name) for name in _limit_options()})
    max_connections = connection_limit(limits.max_connections)
    _warn_if_requests_can_take_every_connection(limits, args.max_num_seqs, max_connections)
    # Listening before loading: a port in use is an error in a second, not after the model loads,
    # and nothing else can take the port between the announcement and uvicorn's start.
    with _listen(args.host, args.port) as listener:
        llm = _load(args)
        for file in args.pin_prompt:
            _pin_prompt(llm, file)
        name = served_model_name(args.served_model_name, args.model, llm.engine.model_path)
        async_engine = AsyncEngine(llm.engine)
        if args.session_dir is not None:
            Path(args.session_dir).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)  # its files hold conversations
        app = build_app(async_engine, name, limits, session_dir=args.session_dir, bind_host=args.host)
        _announce(_base_url(args.host, args.port), name, limits.api_keys())
        try:
            # On SIGTERM the server drains (_GracefulServer): /health fails and new work gets 503 while
            # running requests finish, for at least --drain-grace and at most --shutdown-timeout
            # seconds; then uvicorn stops accepting and cancels what still runs (which aborts it and
            # frees its blocks). A second SIGTERM, or SIGINT, stops at once.
            config = uvicorn.Config(
                app,
                http=guarded_protocol(max_connections, limits.header_timeout_s),
                log_level=args.log_level,
                timeout_keep_alive=limits.keep_alive_timeout_s,
                timeout_graceful_shutdown=args.shutdown_timeout,
            )
            server = _GracefulServer(config, app.state.drain, async_engine, args.drain_grace, args.shutdown_timeout)
            server.run(sockets=[listener])
        finally:
            async_engine.shutdown()  # writes what the tiers' writer has queued, then closes them
    print("kvbank: stopped", flush=True)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port`; one already taken is a ValueError naming both."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        hint = "; something else holds it: pick another with --port" if error.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {reason}{hint}") from None


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce(url: str, name: str, api_keys: tuple[str, ...]) -> None:
    """Where the server is, a request to try that works as printed, and the dashboard's address."""
    print(f"kvbank: model loaded; serving {name!r} with an OpenAI-compatible API at {url}/v1", flush=True)
    # The key itself never goes to the log: the line reads it from the environment.
    auth = '-H "Authorization: Bearer $KVBANK_API_KEY" ' if api_keys else ""
    print(
        f"try: curl {url}/v1/completions {auth}-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}}\'',
        flush=True,
    )
    if api_keys and os.environ.get("KVBANK_API_KEY") not in api_keys:
        which = "the --api-key value" if len(api_keys) == 1 else "one of the --api-key values"
        print(f"     (with KVBANK_API_KEY set to {which})", flush=True)
    sign_in = f" (sign in with {'the' if len(api_keys) == 1 else 'an'} API key)" if api_keys else ""
    print(f"dashboard: {url}/dashboard{sign_in}", flush=True)


def _warn_if_requests_can_take_every_connection(limits: ServerLimits, max_num_seqs: int, max_connections: int) -> None:
    """Running and queued requests hold a connection each: a cap they can fill leaves none for /health."""
    if limits.max_queued_requests is None or max_connections > max_num_seqs + limits.max_queued_requests:
        return
    print(
        f"kvbank: warning: --max-connections {max_connections} is not above --max-num-seqs {max_num_seqs} + "
        f"--max-queued-requests {limits.max_queued_requests}: requests at those limits can hold every "
        "connection, and /health would be refused until one ends",
        file=sys.stderr,
        flush=True,
    )


def _pin_prompt(llm: LLM, file: str) -> None:
    """Pin the chat prefix of the system prompt in `file`; one shorter than a block is a warning."""
    # The file holds a system prompt (its final newline is the editor's, not the prompt's).
    system_prompt = Path(file).read_text().removesuffix("\n")
    prefix = system_prompt_prefix(llm.get_tokenizer(), system_prompt)
    pinned = llm.pin_prefix(prefix)  # 0 for a prefix shorter than a block: only whole blocks are cached
    if pinned:
        print(f"kvbank: pinned {pinned} tokens of {file}", flush=True)
    else:
        print(
            f"kvbank: warning: --pin-prompt {file}: nothing pinned: its chat prefix is {len(prefix)} tokens, "
            f"and only whole blocks of {llm.engine.block_size} tokens (--block-size) are cached",
            file=sys.stderr,
            flush=True,
        )


def _plan(args: argparse.Namespace) -> int:
    config = EngineConfig(**{name: getattr(args, name) for name in _plan_options()})
    info = describe_model(config.model)
    name = model_name(config.model, info.path)
    predicted = memory.predict(config)
    dtype = config.torch_dtype
    context = args.context_len or config.max_model_len or info.config.max_position_embeddings
    budget = int(config.kv_cache_memory_gb * 2**30)
    rows = [_plan_row(info.config, config, kv, context) for kv in KV_CACHE_DTYPES]
    groups = _kv_groups_plan(info.config, config, context)
    if args.json:
        print(
            json.dumps(
                {
                    "model": info.path,
                    "name": name,
                    "num_params": info.num_params,
                    "file_bytes": info.file_bytes,
                    "dtype": str(dtype).removeprefix("torch."),
                    "device": config.device,
                    "weight_format": config.weight_format,
                    "kv_cache_dtype": config.kv_cache_dtype,
                    "memory": {**predicted.parts(), "total": predicted.total, "load_peak": predicted.load_peak},
                    "tied_embeddings": predicted.tied_embeddings,
                    "memory_bytes": budget,
                    "context_len": context,
                    "block_size": config.block_size,
                    "max_num_seqs": config.max_num_seqs,
                    "kernel_isa": isa.report(kernels.native()),
                    "kv_groups": groups,
                    "rows": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"model    {name}: {info.num_params / 1e6:.1f}M parameters, file {_mib(info.file_bytes)}; "
        f"{str(dtype).removeprefix('torch.')} on {config.device}, --weight-format {config.weight_format}, "
        f"--kv-cache-dtype {config.kv_cache_dtype}"
    )
    print("\n".join(predicted.lines()))
    print(f"kernels  {isa.describe(kernels.native())}")
    print()
    print(
        f"KV pool  {_mib(budget)}, blocks of {config.block_size} tokens, context {context} tokens; "
        f"{info.config.num_layers} layers x {info.config.num_kv_heads} KV heads x {info.config.head_dim} dims"
    )
    print(
        f"{'kv_cache_dtype':<15}{'bytes/token':>12}{'vs auto':>9}{'residual/seq':>14}{'tokens':>11}"
        f"{'seqs':>7}{'max seqs':>10}"
    )
    full = rows[0]["bytes_per_token"]
    for row in rows:
        print(
            f"{row['kv_cache_dtype']:<15}{row['bytes_per_token']:>12.1f}{row['bytes_per_token'] / full:>8.3f}x"
            f"{_mib(row['residual_bytes_per_seq']):>14}{row['num_tokens']:>11}{row['sequences']:>7}"
            f"{row['max_sequences']:>10}{'  refused*' if row['refused'] else ''}"
        )
    refused = next((row["refused"] for row in rows if row["refused"]), None)
    if refused:
        print(f"*: this model refuses it: {refused}")
    if groups is not None:
        print(
            f"hybrid KV cache: {groups['layout']}; bytes/token at {context} tokens: full-attention layers "
            f"{groups['full_bytes_per_token']:.1f} + windows {groups['window_bytes_per_token']:.1f} = "
            f"{groups['bytes_per_token']:.1f}, against {groups['swa_full_bytes_per_token']:.1f} keeping every token "
            f"in every layer (--swa-full: {groups['swa_full_max_sequences']} max seqs)"
        )
    print(
        f"seqs: full-length sequences at --max-num-seqs {config.max_num_seqs} (int4/int2 reserve one residual "
        "block per sequence); max seqs: with --max-num-seqs set to that number"
    )
    return 0


def _limit_options() -> list[str]:
    return [f.name for f in dataclasses.fields(ServerLimits) if f.metadata.get("cli", True)]


def _plan_options() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("plan", True)]


def _plan_row(model_config, config: EngineConfig, kv: str, context: int) -> dict[str, Any]:
    plan = plan_pool(
        model_config,
        config.torch_dtype,
        int(config.kv_cache_memory_gb * 2**30),
        config.block_size,
        dataclasses.replace(config.kv_format, dtype=kv),
        reserved_seqs=config.max_num_seqs,
        groups=kv_groups(model_config.layer_windows, config.swa_full),
    )
    per_seq = plan.blocks_per_sequence(context)
    try:
        check_supported(model_config, dataclasses.replace(config, kv_cache_dtype=kv))
        refused = None
    except ValueError as error:  # e.g. quantized KV for a model with sliding-window layers
        refused = str(error)
    return {
        "kv_cache_dtype": kv,
        "refused": refused,
        "bytes_per_token": plan.bytes_per_token_at(context),
        "residual_bytes_per_seq": plan.residual_bytes_per_seq,
        "num_blocks": plan.num_blocks,
        "num_tokens": plan.num_tokens,
        "sequences": min(config.max_num_seqs, plan.num_blocks // per_seq),
        "max_sequences": plan.sequences_that_fit(context),
    }


def _kv_groups_plan(model_config, config: EngineConfig, context: int) -> dict[str, Any] | None:
    """The hybrid layout's bytes per token at `context`, per group, against keeping every token."""
    groups = kv_groups(model_config.layer_windows, config.swa_full)
    if groups is None:
        return None
    args = (model_config, config.torch_dtype, int(config.kv_cache_memory_gb * 2**30), config.block_size)
    plan = plan_pool(*args, config.kv_format, config.max_num_seqs, groups)
    every = plan_pool(*args, config.kv_format, config.max_num_seqs)
    full = -(-context // config.block_size) * plan.bytes_per_block / context
    return {
        "layout": groups.describe(model_config.num_layers),
        "window": groups.window,
        "num_window_tables": groups.num_window_tables,
        "full_bytes_per_token": full,
        "window_bytes_per_token": plan.bytes_per_token_at(context) - full,
        "bytes_per_token": plan.bytes_per_token_at(context),
        "swa_full_bytes_per_token": every.bytes_per_token,
        "max_sequences": plan.sequences_that_fit(context),
        "swa_full_max_sequences": every.sequences_that_fit(context),
    }


def served_model_name(flag: str | None, model: str | None, model_path: str) -> str:
    """The name clients send: --served-model-name, else the model's own name (`model_name`): --model
    exactly as given (as in vLLM), else (the bundled model) its file name without the extension."""
    return flag or model_name(model, model_path)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class _GracefulServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM before it stops, and ends the process with status 0.

    The first SIGTERM starts `drain` (/health answers 503, new work 503) and keeps the listener
    open: the router's health checker sees the 503 and moves traffic while running requests
    finish. The server stops once `drain_grace` seconds have passed and nothing runs, or once
    `deadline` seconds have passed whatever runs; uvicorn's graceful shutdown then gets what is
    left of the deadline. SIGINT, or a second SIGTERM, stops without draining.
    uvicorn re-raises the signal after its graceful shutdown, so the process would die by it: the
    captured signals are dropped.
    """

    def __init__(self, config: uvicorn.Config, drain, async_engine: AsyncEngine, drain_grace: float, deadline: float):
        super().__init__(config)
        self.drain, self.async_engine = drain, async_engine
        self.drain_grace, self.deadline = drain_grace, deadline

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.should_exit and self.drain.start():
            print(
                f"kvbank: draining: /health fails and new requests get 503; stopping once idle after "
                f"{self.drain_grace:g} s, at most {self.deadline:g} s (--drain-grace, --shutdown-timeout)",
                flush=True,
            )
        else:
            super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        started = self.drain.started_at
        if started is None:
            return False
        waited = time.monotonic() - started
        if waited >= self.deadline or (waited >= self.drain_grace and self.drain.idle(self.async_engine)):
            # A write-back pool would take its cache along: send it to the tiers first.
            spilled = await spill_to_tiers(self.async_engine, max(0.0, self.deadline - waited))
            if spilled:
                print(f"kvbank: drained: {spilled} cached chunks written to the tiers", flush=True)
            self.config.timeout_graceful_shutdown = max(0.0, self.deadline - (time.monotonic() - started))
            self.should_exit = True
            return True
        return False


# --- helpers -------------------------------------------------------------------------------------


def _load(args: argparse.Namespace) -> LLM:
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    return LLM(args.model, **options, show_progress=True)  # logs the startup lines (model, KV cache, memory)


@contextlib.contextmanager
def _startup_log_on_stderr():
    """The `kvbank` logger's lines, from INFO up, on stderr as plain text while a command runs: the
    startup log `LLM` writes, and what the engine and the server report later."""
    logger = logging.getLogger("kvbank")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_HELP})


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


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvbank", description="A KV-cache-first LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"kvbank {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    engine, sampling = engine_flags(), sampling_flags()

    generate = commands.add_parser(
        "generate",
        parents=[engine, sampling],
        help="complete one prompt",
        description="Print the completion of PROMPT as it is generated.",
    )
    generate.add_argument("prompt", help="the text to complete")
    _bind(generate, _generate)

    chat = commands.add_parser(
        "chat",
        parents=[engine, sampling],
        help="chat in the terminal",
        description="Multi-turn chat through the model's chat template; each turn reuses the previous turns' KV cache.",
    )
    chat.add_argument("--system-prompt", help="a system message to start the conversation with")
    _bind(chat, _chat)

    serve = commands.add_parser(
        "serve",
        parents=[engine],
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument(
        "--served-model-name",
        help="the model name clients send; requests may also leave out an owner or folder, '.gguf' and the "
        "quantization suffix, in any case (default: the --model value as given, as in vLLM; for the bundled "
        f"model, its file name {Path(BUNDLED_FILE).stem})",
    )
    serve.add_argument(
        "--pin-prompt",
        action="append",
        default=[],
        metavar="FILE",
        help="a system prompt to compute once and keep cached (repeatable): chat requests whose "
        "system message is this file's text reuse it",
    )
    limits = serve.add_argument_group("limits")
    for limit_field in dataclasses.fields(ServerLimits):
        if limit_field.name in _limit_options():
            add_limit_flag(limits, limit_field)
    serve.add_argument(
        "--session-dir",
        metavar="DIR",
        help="folder for POST /v1/sessions/save and /v1/sessions/restore (created if missing; default: no sessions)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to drain (finish running requests while /health and new requests get 503) "
        "before aborting what still runs (default: %(default)s)",
    )
    serve.add_argument(
        "--drain-grace",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, seconds to keep answering (/health 503, new requests 503) even when idle, so a "
        "router's health checks see the replica leave before its port closes: at least the router's "
        "health-check interval x failure threshold (default: %(default)s)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: %(default)s)",
    )
    _bind(serve, _serve)

    plan = commands.add_parser(
        "plan",
        help="where memory goes, and how much KV cache fits",
        description="From the model's metadata alone: the memory the engine will hold, "
        "part by part (packed and dense weights, embeddings, LM head, KV pool, "
        "residual slots) and the peak while loading; then KV bytes per token "
        "for every --kv-cache-dtype and how many tokens and full-length "
        "sequences fit. The engine builds its model and sizes its pool the "
        "same way.",
    )
    group = plan.add_argument_group("engine (the options that change these numbers)")
    for config_field in dataclasses.fields(EngineConfig):
        if config_field.name in _plan_options():
            add_config_flag(group, config_field, aliases=_PLAN_ALIASES.get(config_field.name, ()))
    plan.add_argument(
        "--context-len",
        type=int,
        help="tokens per sequence (default: --max-model-len, else the model's context length)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _bind(plan, _plan)
    return parser


def _bind(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int]) -> None:
    parser.set_defaults(command=command, parser=parser)

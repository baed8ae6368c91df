"""The command line's flags, generated from the options' definitions: every EngineConfig field, every
ServerLimits field and the SamplingParams fields a terminal can use, each `--kebab-case` of its name with
its kind read from the field's type."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

from kvbank.config import EngineConfig
from kvbank.defaults import CLI_MAX_TOKENS
from kvbank.engine.params import SamplingParams
from kvbank.server.limits import ServerLimits

_ENGINE_TYPES = typing.get_type_hints(EngineConfig)
_LIMIT_TYPES = typing.get_type_hints(ServerLimits)
_SAMPLING_TYPES = typing.get_type_hints(SamplingParams)


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching (`--max-tokens` must not become `--max-tokens-cap`), whose
    errors print the command's usage line and the error, not the whole option list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage()
        if usage.count("\n") > 1:
            usage = f"usage: {self.prog} [-h] ...  ({self.prog} --help lists the options)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def engine_flags() -> argparse.ArgumentParser:
    flags = Parser(add_help=False)
    group = flags.add_argument_group("engine")
    for config_field in dataclasses.fields(EngineConfig):
        add_config_flag(group, config_field)
    return flags


def add_config_flag(group, config_field: dataclasses.Field, aliases: Sequence[str] = ()) -> None:
    _add_field_flag(group, config_field, _ENGINE_TYPES, aliases)


def add_limit_flag(group, limit_field: dataclasses.Field) -> None:
    _add_field_flag(group, limit_field, _LIMIT_TYPES)


def _add_field_flag(group, field: dataclasses.Field, types: dict, aliases: Sequence[str] = ()) -> None:
    """The flag of one option field: its help, choices, metavar and flag name from its metadata, its
    default from its environment variable where it names one."""
    meta = field.metadata
    env = meta.get("env")
    _add_flag(
        group,
        field.name,
        types[field.name],
        os.environ.get(env, field.default) if env else field.default,
        meta.get("help", field.name.replace("_", " ")),
        choices=meta.get("choices"),
        metavar=meta.get("metavar"),
        default_text=meta.get("default_text"),
        aliases=aliases,
        flag=meta.get("flag"),
    )


def _add_flag(
    group,
    name: str,
    hint: Any,
    default: Any,
    help_text: str,
    *,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    aliases: Sequence[str] = (),
    flag: str | None = None,
) -> None:
    """One flag for a field (`--kebab-case` of its name unless `flag` says), its kind read from the field's type."""
    shown = "%(default)s" if default_text is None else default_text.replace("%", "%%")
    kwargs: dict[str, Any] = {
        "dest": name,
        "default": default,
        "help": f"{help_text.replace('%', '%%')} (default: {shown})",
    }
    union = typing.get_origin(hint) in (types.UnionType, typing.Union)
    kinds = {arg for arg in typing.get_args(hint) if arg is not type(None)} if union else {hint}
    if kinds == {bool}:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif any(typing.get_origin(kind) in (tuple, list) and typing.get_args(kind)[0] is int for kind in kinds):
        kwargs.update(type=_int_list, metavar=metavar or "I,J,...")
    elif any(typing.get_origin(kind) is list for kind in kinds):
        kwargs.update(action=Repeatable, metavar=metavar)  # e.g. --stop A --stop B
    else:
        (kind,) = kinds
        kwargs.update(type=kind, choices=choices, metavar=metavar)
    group.add_argument(flag or "--" + name.replace("_", "-"), *aliases, **kwargs)


class Repeatable(argparse.Action):
    """A repeatable flag: each use adds its value to a list, and the first replaces the default (an
    environment variable's value, for one) where argparse's "append" would add to it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if given is self.default or given is None else given), values])


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


# What each SamplingParams field means on the command line. Every field is here or in
# SAMPLING_NOT_ON_CLI (tests/test_cli.py checks), so the flags follow SamplingParams.
SAMPLING_HELP = {
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling: sample from the most likely tokens that hold this much probability",
    "top_k": "sample from the k most likely tokens; 0 or -1 keeps all",
    "min_p": "drop tokens less likely than this fraction of the most likely one",
    "presence_penalty": "lower (or, negative, raise) the logits of tokens already in the output",
    "frequency_penalty": "like --presence-penalty, scaled by how often the token occurred",
    "repetition_penalty": "divide positive (multiply negative) logits of tokens seen in prompt or output",
    "max_tokens": "most tokens to generate",
    "min_tokens": "tokens to generate before EOS or a stop may end the reply",
    "stop": "a string that ends the reply (repeatable)",
    "stop_token_ids": "token ids that end the reply, e.g. 2,7",
    "include_stop_str_in_output": "keep the stop string that ended the reply",
    "ignore_eos": "keep generating past the end-of-sequence token",
    "skip_special_tokens": "leave special tokens out of the printed text",
}
SAMPLING_NOT_ON_CLI = {
    "n": "the terminal shows one reply",
    "seed": "--seed seeds the sampler of the one engine a command runs",
    "logprobs": "the terminal prints text only",
    "prompt_logprobs": "the terminal prints text only",
    "logit_bias": "a map of token ids to biases: pass it through the Python API or the HTTP API",
    "kv_policy": "the engine option --kv-policy sets it for the one engine a command runs",
    "priority": "a command runs one request at a time: there is no queue to order",
}
_SAMPLING_DEFAULT_TEXT = {"stop": "none", "stop_token_ids": "none"}


def sampling_flags() -> argparse.ArgumentParser:
    flags = Parser(add_help=False)
    group = flags.add_argument_group("sampling")
    for param in dataclasses.fields(SamplingParams):
        if param.name in SAMPLING_HELP:
            default = CLI_MAX_TOKENS if param.name == "max_tokens" else param.default
            _add_flag(
                group,
                param.name,
                _SAMPLING_TYPES[param.name],
                default,
                SAMPLING_HELP[param.name],
                default_text=_SAMPLING_DEFAULT_TEXT.get(param.name),
            )
    return flags

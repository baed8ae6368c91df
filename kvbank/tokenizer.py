"""Text <-> token ids for one model, built from GGUF metadata or from a Hugging Face tokenizer folder.

The `tokenizers` library does the actual encoding and decoding. This module translates a model's
description of its tokenizer (llama.cpp's `tokenizer.ggml.*` keys, or HF's json files) into a
`tokenizers.Tokenizer`, and adds what generation needs around it: whether to prepend BOS, which ids
end a turn, the chat template, and streaming detokenization.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Engine


class GGUFMetadata(Protocol):
    """What the tokenizer reads of a GGUF file (models/gguf_file.py's reader): its metadata."""

    fields: Mapping[str, Any]


# llama.cpp's token types, numbered like SentencePiece's piece types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Split patterns of the byte-level vocabularies whose merges were not learned on GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's vocabulary has tokens its merges cannot build; llama.cpp looks a whole word up first.
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe"}

# Older GGUFs name only one end-of-generation id (often the document end, not the turn end), so,
# as llama.cpp does, a control token spelled like a well-known end marker also stops generation.
_END_MARKERS = {
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
}


def check_unicode(text: str, name: str = "text") -> str:
    """`text`, if it is valid Unicode; else a ValueError naming `name` and where it is not. JSON's
    "\\ud800" escapes without their pair decode to lone surrogates, which no tokenizer, hash or
    UTF-8 answer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = error.start
        raise ValueError(
            f"{name} holds a lone surrogate ({text[where]!r} at character {where}), which is not valid Unicode"
        ) from None
    return text


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        engine: _Engine,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; `from_gguf` and `from_folder` are the usual ways in.

        `stop_token_ids` is added to the EOS id; BOS is prepended by `encode` only when
        `add_bos_token` is set (the engine's own post-processor is never used for this).
        """
        self._engine = engine
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(
            token_id for token_id in (eos_token_id, *stop_token_ids) if token_id is not None
        )
        self.chat_template = chat_template
        self._add_bos = add_bos_token and bos_token_id is not None
        self.vocab_size = max(engine.get_vocab(with_added_tokens=True).values()) + 1
        # token_text decodes after these ids, so decoders that drop the first token's leading
        # space (SentencePiece's) leave it on the token asked about.
        self._anchor_ids = engine.encode("a", add_special_tokens=False).ids
        self._anchor_text = engine.decode(self._anchor_ids, skip_special_tokens=False)

    @classmethod
    def from_gguf(cls, reader: GGUFMetadata) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        model = _gguf_value(reader, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF file has no tokenizer: tokenizer.ggml.model is missing")
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"GGUF tokenizer {model!r} has no tokenizer.ggml.tokens")
        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        pre = _gguf_value(reader, "tokenizer.ggml.pre", "default")

        if model == "gpt2":
            merges = _gguf_value(reader, "tokenizer.ggml.merges", [])
            engine = _byte_level_engine(tokens, merges, pre)
            # Where the file does not say, BOS is added as llama.cpp does: for SentencePiece
            # vocabularies, and among byte-level ones only for Llama 3's.
            add_bos_default = pre in _LLAMA3_PRE
            default_bos = default_eos = None
        elif model == "llama":
            scores = _gguf_value(reader, "tokenizer.ggml.scores")
            if scores is None:
                raise ValueError("GGUF tokenizer 'llama' has no tokenizer.ggml.scores")
            unk_id = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
            add_space_prefix = _gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)
            engine = _sentencepiece_engine(tokens, scores, token_types, unk_id, add_space_prefix)
            add_bos_default = True
            default_bos, default_eos = 1, 2
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); supported: 'gpt2', 'llama'"
            )
        _add_matched_whole(engine, tokens, token_types)

        bos_id = _gguf_value(reader, "tokenizer.ggml.bos_token_id", default_bos)
        eos_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id", default_eos)
        add_bos = bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
        stops = {
            _gguf_value(reader, "tokenizer.ggml.eot_token_id"),
            _gguf_value(reader, "tokenizer.ggml.eom_token_id"),
        }
        stops.update(
            token_id
            for token_id, (token, kind) in enumerate(zip(tokens, token_types))
            if kind == _CONTROL and token in _END_MARKERS
        )
        stops.discard(None)
        if add_bos and bos_id is not None:
            # Only for whoever loads a saved tokenizer.json; encode() prepends BOS itself.
            bos = tokens[bos_id]
            engine.post_processor = processors.TemplateProcessing(
                single=[bos, "$A"], pair=[bos, "$A", bos, "$B"], special_tokens=[(bos, bos_id)]
            )
        return cls(
            engine,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            stop_token_ids=sorted(stops),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
            add_bos_token=add_bos,
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json and, when
        present, special_tokens_map.json, generation_config.json and chat_template.jinja."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in tokenizer folder {str(folder)!r}")
        engine = _Engine.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        bos_id = _token_id(engine, config.get("bos_token", special_map.get("bos_token")))
        eos_id = _token_id(engine, config.get("eos_token", special_map.get("eos_token")))
        # generation_config.json lists every id that ends generation (e.g. Llama 3's <|eot_id|>).
        stops = generation.get("eos_token_id") or []
        if isinstance(stops, int):
            stops = [stops]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: BOS is added if the tokenizer.json post-processor adds it.
            with_special = engine.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_special[:1] == [bos_id]

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_template(config.get("chat_template"))

        return cls(
            engine,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            stop_token_ids=stops,
            chat_template=chat_template,
            add_bos_token=bool(add_bos),
        )

    def save(self, folder: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (and the stop ids as generation_config.json's
        eos_token_id) so that `from_folder` reads back the same tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._engine.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_string(self.bos_token_id),
            "eos_token": self._token_string(self.eos_token_id),
            "add_bos_token": self._add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        _write_json(folder / "tokenizer_config.json", config)
        if self.stop_token_ids:
            # Merged into any generation_config.json already there (a model export may write one).
            generation_path = folder / "generation_config.json"
            generation = _read_json(generation_path)
            rest = sorted(self.stop_token_ids - {self.eos_token_id})
            first = [self.eos_token_id] if self.eos_token_id is not None else []
            generation["eos_token_id"] = first + rest
            _write_json(generation_path, generation)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of text one token stands for (its leading space included), so a
        text of B bytes encodes to at least B / this many tokens; None where the normalizer may
        shorten text before it is split (then the byte count bounds nothing). ~0.1 s, once."""
        if not _never_shortens(json.loads(self._engine.to_str()).get("normalizer")):
            return None
        return max(len(self.token_text(i).encode("utf-8", "surrogatepass")) for i in range(self.vocab_size)) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text become their single ids; BOS is
        prepended when the model asks for it and `add_special_tokens` is set."""
        try:
            ids = self._engine.encode(text, add_special_tokens=False).ids
        except TypeError:
            if isinstance(text, str):
                check_unicode(text)  # the tokenizers library says only "must be str" of a lone surrogate
            raise
        if add_special_tokens and self._add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text for `ids`; special tokens (BOS, EOS, chat markers) are dropped unless asked for.
        An id no vocabulary holds (a negative one, or one past 32 bits) is a ValueError naming it."""
        return self._decode(list(ids), skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, leading space included (for logprob displays). A token
        holding part of a multi-byte character gives U+FFFD."""
        text = self._decode([*self._anchor_ids, token_id], False)
        if text.startswith(self._anchor_text):
            return text[len(self._anchor_text) :]
        return self._decode([token_id], False)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        try:
            return self._engine.decode(ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:
            # The tokenizers library takes ids as unsigned 32-bit integers and names none it cannot.
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is out of range [0, {self.vocab_size})") from None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers does: the template
        sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
        `strftime_now`, a `tojson` filter, and `kwargs` (e.g. `tools`). With `tokenize`, return the
        ids of the rendered text, BOS not added (the template writes it where the model wants it)."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (chat_template is None); give one with --chat-template / "
                "LLM(chat_template=...)"
            )
        context = {
            "bos_token": self._token_string(self.bos_token_id) or "",
            "eos_token": self._token_string(self.eos_token_id) or "",
            **kwargs,
        }
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def _token_string(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._engine.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, never emitting half a UTF-8 character."""

    # Prompt ids kept as context, so the first generated token decodes as it does inside the
    # whole text (SentencePiece decoders drop the leading space of a text's first token).
    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """Start after `prompt_ids` (used as context only; their text is never emitted)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Decoding everything at each step would be quadratic, so only a window is decoded:
        # ids[:_read] were emitted in full and are kept only as context for ids[_read:], of
        # whose text the first _sent characters are out already.
        self._ids = list(prompt_ids[-self._PROMPT_CONTEXT :])
        self._read = len(self._ids)
        self._sent = 0
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ('' while a character is unfinished)."""
        self._ids.extend(new_ids)
        pending = self._pending_text()
        if pending.endswith("\ufffd"):
            # The last ids end inside a multi-byte character (decoded as U+FFFD until complete):
            # send what precedes it, keep the ids.
            ready = pending.rstrip("\ufffd")
            delta = ready[self._sent :]
            self._sent = max(self._sent, len(ready))
        elif pending:
            delta = pending[self._sent :]
            self._advance()
        else:
            # Nothing to show (e.g. a skipped special token): keep the old context, which is what
            # the next token's leading space depends on.
            delta = ""
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is still held back, e.g. at the end of generation; an unfinished
        character comes out as U+FFFD."""
        delta = self._pending_text()[self._sent :]
        self._advance()
        self.text += delta
        return delta

    def _pending_text(self) -> str:
        decode = self._tokenizer.decode
        context = decode(self._ids[: self._read], skip_special_tokens=self._skip_special)
        decoded = decode(self._ids, skip_special_tokens=self._skip_special)
        return decoded[len(context) :]

    def _advance(self) -> None:
        # The ids just emitted become the context of the next window.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._sent = 0


def _never_shortens(normalizer: dict | None) -> bool:
    """Whether a normalizer (tokenizer.json's form) only ever keeps or lengthens text: none, a
    prefix added, a replacement by something no shorter (SentencePiece's " " -> "▁"), in sequence."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content")
        return isinstance(pattern, str) and isinstance(content, str) and len(content.encode()) >= len(pattern.encode())
    if kind == "Sequence":
        return all(_never_shortens(part) for part in normalizer.get("normalizers", []))
    return False


def _gguf_value(reader: GGUFMetadata, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _byte_level_engine(tokens: list[str], merges: list[str], pre: str) -> _Engine:
    """GPT-2 style byte-level BPE: the file's tokens are already spelled in GPT-2's byte alphabet."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    engine = _Engine(models.BPE(vocab, pairs, ignore_merges=pre in _LLAMA3_PRE))
    split = _SPLIT_BY_PRE.get(pre)
    if split is not None:
        engine.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        # SmolLM's vocabulary has no multi-digit tokens: numbers are split into single digits.
        engine.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        engine.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    engine.decoder = decoders.ByteLevel()
    return engine


def _sentencepiece_engine(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    unk_id: int | None,
    add_space_prefix: bool,
) -> _Engine:
    """SentencePiece BPE (Llama 2, Mistral): spaces are spelled "▁", and characters outside the
    vocabulary fall back to `<0xXX>` byte tokens."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    model = models.BPE(
        vocab,
        _merges_from_scores(tokens, scores, token_types),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    engine = _Engine(model)
    # Normalizers run on each stretch of text between special tokens, so, like llama.cpp, a space
    # is prefixed after every special token, not only at the start.
    spaces = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        spaces.insert(0, normalizers.Prepend("▁"))
    engine.normalizer = normalizers.Sequence(spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    engine.decoder = decoders.Sequence(steps)
    return engine


def _merges_from_scores(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """The BPE merge table a SentencePiece vocabulary implies.

    SentencePiece stores no merges: at each step it joins the adjacent pair whose concatenation is
    the highest-scoring piece. Every way of cutting a piece into two pieces, ranked by the score of
    the whole, is a merge table that makes the same choices.
    """
    pieces = {token: token_id for token_id, (token, kind) in enumerate(zip(tokens, token_types)) if kind == _NORMAL}
    ranked = []
    for piece, piece_id in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[piece_id], pieces[left], pieces[right]))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _add_matched_whole(engine: _Engine, tokens: list[str], token_types: list[int]) -> None:
    """Register control and user-defined tokens as added tokens, so they are matched whole in text
    instead of being cut into pieces. Control ones are special (skipped when decoding)."""
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind in (_UNKNOWN, _CONTROL) and token
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and token
    ]
    engine.add_special_tokens(special)
    engine.add_tokens(user_defined)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_id(engine: _Engine, token: str | dict | None) -> int | None:
    # tokenizer_config.json writes a token either as its text or as a serialized AddedToken.
    if isinstance(token, dict):
        token = token.get("content")
    return engine.token_to_id(token) if token else None


def _pick_template(template: str | list | None) -> str | None:
    # Some configs hold several named templates; the one named "default" is the chat template.
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default", next(iter(named.values()), None))
    return template


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_TEMPLATES = _template_environment()


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    return _TEMPLATES.from_string(source)


def load_chat_template(value: str) -> str:
    """The chat template `value` names: the text of a file, else `value` itself when it is a Jinja
    template; ValueError when it is neither or does not compile."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        source = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"chat_template={value[:80]!r} is neither a file nor a Jinja template")
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template does not compile: {error.message} (line {error.lineno})") from None
    return source

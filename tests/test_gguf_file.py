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

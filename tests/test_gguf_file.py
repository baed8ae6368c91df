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
    whole = open(bundled_model_path(), "rb").read(8 << 20)  # the header and the first tensors only
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole)
    with pytest.raises(ValueError, match=r"ends at byte \d+, past the file's 8388608"):
        GGUFFile(str(cut))

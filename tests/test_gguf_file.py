"""kvloom's GGUF reader (``kvloom.core.model.gguf_file``) and chunked dequantization read the same fields,
tensors and values as gguf-py, on the default SmolLM2 GGUF file, and name what is wrong with a bad file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloom.core.model import loader
from kvloom.core.model.gguf_file import GGUFArray, GGUFFile


@pytest.fixture(scope="module")
def both(smollm2_path):
    from gguf import GGUFReader

    return GGUFFile(smollm2_path), GGUFReader(str(smollm2_path))


def test_fields_and_tensor_table_equal_gguf_py(both):
    mine, ref = both
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(mine.fields) == keys
    for key in keys:
        got, want = mine.fields[key], ref.fields[key].contents()
        if isinstance(got, GGUFArray):  # the tokenizer's big arrays: only their length is read
            assert got.count == len(ref.fields[key].data) > 1024, key
        else:
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert isinstance(mine.fields["tokenizer.ggml.tokens"], GGUFArray)
    assert [(t.name, t.tensor_type, t.shape) for t in mine.tensors] == \
        [(t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in ref.tensors]
    for a, b in zip(ref.tensors, mine.tensors):
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape and np.array_equal(b.data, a.data), a.name


def test_chunked_dequantization_equals_gguf_py_for_each_type(both, monkeypatch):
    from gguf.quants import dequantize

    mine, ref = both
    firsts = {}
    for a, b in zip(ref.tensors, mine.tensors):
        firsts.setdefault((a.tensor_type, len(a.shape)), (a, b))
    assert {t.name for t, _ in firsts} >= {"F32", "Q4_1"}
    monkeypatch.setattr(loader, "DEQUANTIZE_CHUNK_BYTES", 4096)  # many chunks per tensor, one ragged
    for a, b in firsts.values():
        want = torch.from_numpy(dequantize(a.data, a.tensor_type).copy())
        got = loader.dequantize_tensor(b)
        assert got.dtype == torch.float32 and got.shape == want.shape and torch.equal(got, want), a.name
        mine.release(b)  # the pages come back when read again
        assert torch.equal(loader.dequantize_tensor(b), want), a.name


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    for content in (b"not a gguf file at all", b"", b"GGUF"):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=r"model\.gguf' is not a GGUF file"):
            GGUFFile(bad)


def test_a_truncated_file_is_named(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(8 << 20))
    with pytest.raises(ValueError, match=r"cut\.gguf': tensor '.*' runs past the end of the file"):
        GGUFFile(cut)


def test_metadata_cut_short_is_named(tmp_path, smollm2_path):
    cut = tmp_path / "short.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # inside the tokenizer's vocabulary
    with pytest.raises(ValueError, match=r"short\.gguf': GGUF metadata cut short or corrupt at byte \d+"):
        GGUFFile(cut)

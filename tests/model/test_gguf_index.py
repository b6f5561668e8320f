"""GGUFFile keeps what gguf-py's reader found (fields, each tensor's type, shape and place) in the cache: a
second open reads that index, not the file's metadata, and gives the same fields and the same tensor views;
a file that changes is read again."""
import os

import gguf
import numpy as np
import pytest

from specserve.errors import ModelLoadError
from specserve.model import gguf_convert
from specserve.model.gguf_convert import GGUFFile
from tests.model.family_fixtures import make_family_dir, write_family_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def test_second_open_reads_the_index(tmp_path, cache, monkeypatch):
    path = tmp_path / "m.gguf"
    write_family_gguf(path, make_family_dir(tmp_path / "hf", "qwen3_moe"), "qwen3_moe", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    first = GGUFFile(path)
    assert len(list((cache / "gguf_index").iterdir())) == 1

    def no_parse(*args, **kwargs):
        raise AssertionError("the metadata was parsed again")
    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = GGUFFile(path)
    for g in (first, second):
        assert g.fields == {key: field.contents() for key, field in reader.fields.items()}
        assert [(t.name, t.tensor_type, t.shape) for t in g.tensors] == \
            [(t.name, t.tensor_type, list(t.shape)) for t in reader.tensors]
        for ours, theirs in zip(g.tensors, reader.tensors):
            assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)

    later = os.stat(path).st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))  # a changed file (its time) is not served from the old index
    with pytest.raises(ModelLoadError, match="parsed again"):
        GGUFFile(path)

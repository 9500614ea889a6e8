"""The GGUF header reader agrees with gguf's own writer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from heron.core.gguf_header import read_gguf_header, read_gguf_value


def test_reads_values_written_by_gguf_writer(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(7)
    w.add_string("some.text", "h\u00e9llo")
    w.add_array("some.list", [1, 2, 3])
    w.add_float32("some.float", 0.5)
    w.add_tensor("t", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf_value(path, "general.architecture") == "qwen3"
    assert read_gguf_value(path, "qwen3.block_count") == 7
    assert read_gguf_value(path, "some.text") == "h\u00e9llo"
    assert read_gguf_value(path, "some.list") == [1, 2, 3]
    assert read_gguf_value(path, "some.float") == 0.5
    with pytest.raises(KeyError):
        read_gguf_value(path, "missing.key")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_value(bad, "general.architecture")


def test_the_whole_header_reads_as_gguf_reads_it(default_gguf_path):
    metadata, shapes = read_gguf_header(default_gguf_path)
    reader = gguf.GGUFReader(default_gguf_path)
    assert metadata.keys() == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key in ("general.architecture", "tokenizer.ggml.tokens", "llama.rope.freq_base"):
        assert metadata[key] == reader.fields[key].contents(), key
    assert shapes == {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}

"""Reports and cards are written atomically: an interrupted write leaves the old file whole; a file's digest
reads all of it."""
import hashlib
import os
from pathlib import Path

import pytest

from specdec.files import sha256_file, write_text


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    write_text(path, "old report")

    def crash(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_text(path, "new report that never lands")
    assert path.read_text() == "old report"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    monkeypatch.undo()
    write_text(path, "new report")
    assert path.read_text() == "new report"


def test_an_interrupted_tensor_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from specdec.files import save_tensors

    path = tmp_path / "shard.safetensors"
    old = torch.arange(6).view(2, 3).t()  # not contiguous: saved all the same
    save_tensors({"a": old}, path, metadata={"items": "2"})

    def crash(src, dst):
        assert Path(src).exists()  # the new file was written in full beside the old one
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_tensors({"a": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.equal(load_file(str(path))["a"], old)
    assert [p.name for p in tmp_path.iterdir()] == ["shard.safetensors"]


def test_a_files_digest_covers_every_block(tmp_path):
    """Past the first 16 MiB read block too: a digest of the first block only would name two files alike."""
    data = os.urandom((1 << 24) + 1000)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(data)
    b.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert sha256_file(a) == hashlib.sha256(data).hexdigest() != sha256_file(b)

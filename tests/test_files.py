"""Reports and cards are written atomically: an interrupted write leaves the old file whole."""
import os
from pathlib import Path

import pytest

from specdec.files import write_text


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

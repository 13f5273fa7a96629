"""The README and docs/ stay true to the repository: every Python block of the README runs (in order, one
namespace, as a reader would paste them), every link between them resolves, every results file they
cite exists and starts with the command that produced it, and every results file backs something that
is still said (history no claim rests on goes; git keeps it)."""
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"


def cited_results() -> dict[Path, set[str]]:
    """{results file: the pages citing it}, for every `results/NAME.md` (or .json) a page names."""
    cited: dict[Path, set[str]] = {}
    for page in DOCS:
        for name in re.findall(r"results/([\w.\-]+\.(?:md|json))", page.read_text()):
            cited.setdefault(RESULTS / name, set()).add(page.name)
    return cited


def test_every_cited_results_file_exists_and_starts_with_its_command():
    cited = cited_results()
    assert cited, "no results cited: the pattern no longer matches the pages"
    for path, pages in cited.items():
        assert path.exists(), f"{sorted(pages)} cite {path.relative_to(ROOT)}, which does not exist"
        if path.suffix == ".md":
            head = "\n".join(path.read_text().splitlines()[:8])
            assert re.search(r"(python|specdec) [\w/.-]", head), \
                f"{path.relative_to(ROOT)} does not start with its command (first 8 lines)"


def claim_sources() -> list[Path]:
    """Where a claim can rest on a results file: the pages, the benchmarks' index, the modules' docstrings
    (a rule measured once, such as hf/packed.py's), the model cards and the benchmark scripts."""
    return [*DOCS, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "specdec").rglob("*.py")),
            *sorted((ROOT / "specdec" / "zoo" / "models").glob("*/*.md")), *sorted((ROOT / "benchmarks").rglob("*.py"))]


def test_every_results_file_backs_a_claim():
    text = "\n".join(p.read_text() for p in claim_sources())
    names = {n.split("results/")[-1] for n in re.findall(r"[\w.*/-]+\.(?:md|json|png)", text)}
    # a name, or a pattern specific enough to name a family (`linear_rows*.md`), not `*.json` or `real_*.md`
    cited = {n for n in names if re.match(r"\w{3}", n) and ("*" not in n or n.index("*") >= 8)}
    folders = set(re.findall(r"results/([\w-]+)/", text))
    assert cited, "the pattern no longer matches the sources"
    unbacked = []
    for f in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = f.relative_to(RESULTS).as_posix()
        report = rel.rsplit(".", 1)[0] + ".md"  # a .json or .png beside the report that cites it
        if not (any(fnmatch(name, pattern) for pattern in cited for name in (rel, report, f.name))
                or rel.split("/")[0] in folders):
            unbacked.append(rel)
    assert not unbacked, f"results files nothing cites (history: delete them, git keeps it): {unbacked}"


def test_every_link_between_the_pages_resolves():
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


@pytest.mark.filterwarnings("ignore")
def test_the_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # noqa: S102 (our own README)

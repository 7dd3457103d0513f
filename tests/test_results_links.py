"""Every saved result the docs cite exists: `benchmarks/results/...` (or `results/...`) paths in README.md, docs/*.md,
benchmarks/*.md and benchmarks/results/INDEX.md, and in INDEX.md the file names it gives relative to its folder
(`archive/...` for the older runs). Patterns (`*`, `{a,b}`, `<stamp>`, `...`) and name prefixes are not checked."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCS = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)), *sorted(glob.glob("benchmarks/*.md", root_dir=ROOT)),
        "benchmarks/results/INDEX.md"]
EXT = r"\.(?:json|log|txt|md|jsonl|csv)"
PATH = re.compile(r"(?<![\w./-])(?:\.\./)*(?:benchmarks/)?results/([\w./-]+?" + EXT + r")(?![\w*{<])")
BARE = re.compile(r"`((?:archive/)?[A-Za-z][\w.-]*20\d{6}[\w.-]*" + EXT + r")`")


def cited(doc: str) -> set[str]:
    """Paths under benchmarks/results/ that `doc` cites as whole file names."""
    with open(os.path.join(ROOT, doc)) as fh:
        text = fh.read()
    out = {m.group(1) for m in PATH.finditer(text)}
    if doc.endswith("INDEX.md"):
        out |= {m.group(1) for m in BARE.finditer(text)}
    return {p for p in out if "..." not in p}


def test_cited_results_exist():
    missing = {doc: sorted(p for p in cited(doc) if not os.path.exists(os.path.join(RESULTS, p))) for doc in DOCS}
    missing = {doc: ps for doc, ps in missing.items() if ps}
    assert not missing, f"cited results that do not exist: {missing}"


def test_results_top_level_is_small():
    top = [f for f in os.listdir(RESULTS) if os.path.isfile(os.path.join(RESULTS, f))]
    assert len(top) <= 80, f"{len(top)} files at the top of benchmarks/results/: move older ones to archive/"

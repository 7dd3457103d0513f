"""The README's performance table from a saved sweep summary: `python -m benchmarks table [--write README.md]`.

Reads the sweep result named by `SWEEP` below (under `benchmarks/results/`; "newest": the newest
`sweep-*-merged*.json` by the date in its name) or `--sweep PATH`, and prints a markdown table: per direction
(forward, backward, fwd+bwd) the median of FBGEMM time / our device time, the share of shards at >= 1.0x and >= 1.2x
and the minimum (its "summary" key, see `benchmarks/sweep.py`); the named shards (presets, DLRMv2: its "named" key);
the host time per jitted call (`dispatch_us`). With `--write FILE` the text between `<!-- perf-table:begin -->` and
`<!-- perf-table:end -->` in FILE is replaced by the table; a file without both markers is left alone (exit 1).
`--by-class` prints, instead, the drawn shards' ratios by class (row width, bag length, storage dtype): where
a tail sits (session 50 found the forward's in rows wider than 128 with short bags this way).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

# The saved sweep the README's table comes from: a file name under benchmarks/results/ (or a path), or "newest".
# The 196-shard merged run of 2026-12-02 is the last complete one; the 80-shard run of 2026-12-03 is a partial one.
SWEEP = "sweep-20261207-s58-NVIDIA_H200.json"

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DIRECTIONS = (("fwd", "forward"), ("bwd", "backward"), ("fwdbwd", "fwd+bwd"))


def newest_sweep(results: str = RESULTS) -> str:
    """The newest `sweep-*-merged*.json` under `results` (and its archive/) by the date and time in its name."""
    paths = glob.glob(os.path.join(results, "sweep-*-merged*.json")) + \
        glob.glob(os.path.join(results, "archive", "sweep-*-merged*.json"))
    if not paths:
        raise SystemExit(f"no sweep-*-merged*.json under {results}")

    def stamp(p):
        m = re.search(r"(\d{8})(?:-(\d{4,6}))?", os.path.basename(p))
        return (m.group(1), m.group(2) or "") if m else ("", "")

    return max(paths, key=lambda p: (stamp(p), os.path.basename(p)))


def resolve(spec: str) -> str:
    if spec == "newest":
        return newest_sweep()
    for cand in (spec, os.path.join(RESULTS, spec), os.path.join(RESULTS, "archive", spec)):
        if os.path.exists(cand):
            return cand
    raise SystemExit(f"no sweep result {spec!r} (looked in {RESULTS} and its archive/)")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%".replace(".0%", "%")


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(result: dict, source: str = "") -> str:
    """The markdown text of the performance table of one sweep result (its "summary", "named" and "meta" keys)."""
    s = result.get("summary", {})
    named = result.get("named") or {}
    meta = result.get("meta") or {}
    lines = []
    what = f"`{source}`" if source else "a saved sweep"
    facts = ", ".join(f"{k} {meta[k]}" for k in ("device", "fbgemm_gpu", "jax") if meta.get(k))
    lines.append(f"FBGEMM time / our device time over {s.get('shapes', '?')} drawn shard shapes ({what}"
                 + (f"; {facts}" if facts else "") + "); > 1: faster than FBGEMM.")
    lines.append("")
    lines.append("| direction | median | >= 1.0x | >= 1.2x | min |")
    lines.append("|---|---|---|---|---|")
    for key, label in DIRECTIONS:
        d = s.get(key)
        if not d:
            continue
        lines.append(f"| {label} | {_x(d.get('median'))} | {_pct(d.get('share_ge_1'))} | "
                     f"{_pct(d.get('share_ge_1_2'))} | {_x(d.get('min'))} |")
    rows = [(name, r) for name, r in named.items() if r]
    if rows:
        lines.append("")
        lines.append("| named shard | forward | backward | fwd+bwd |")
        lines.append("|---|---|---|---|")
        for name, r in rows:
            lines.append(f"| {name} | " + " | ".join(_x(r.get(k)) for k, _ in DIRECTIONS) + " |")
        missing = [name for name, r in named.items() if not r]
        if missing:
            lines.append("")
            lines.append(f"Not measured on both sides in this run: {', '.join(missing)}.")
    disp = s.get("dispatch_us")
    if disp:
        lines.append("")
        parts = [f"{k} {v:.1f}" for k, v in disp.items() if k != "floor" and isinstance(v, (int, float))]
        floor = disp.get("floor")
        lines.append("Host time per jitted call (us): " + ", ".join(parts)
                     + (f" (JAX's floor, a jitted `x + 1`: {floor:.1f})" if isinstance(floor, (int, float)) else "")
                     + ".")
    return "\n".join(lines) + "\n"


def shard_class(row: dict) -> str:
    """A drawn shard's class: its rows' width ("D<=128", "D>128" or "mixed" when its tables are on both sides of
    128), its bags ("short": every table's mean bag length under 4, else "long") and its storage dtype."""
    dims = row["dims"]
    width = "D<=128" if max(dims) <= 128 else "D>128" if min(dims) > 128 else "mixed"
    bags = "short" if max(row["bags"]) < 4 else "long"
    return f"{width} {bags} {row.get('weights_dtype', '?')}"


def by_class(result: dict) -> str:
    """Markdown: per class of drawn shards (`shard_class`) and direction, the count, median and min ratio."""
    groups: dict = {}
    for row in result.get("table") or []:
        ratio = row.get("ratio") or {}
        if row.get("shard", "").startswith("s") and ratio:
            groups.setdefault(shard_class(row), []).append(ratio)
    lines = ["| class | shards | " + " | ".join(f"{label} median / min" for _, label in DIRECTIONS) + " |",
             "|---|---|" + "---|" * len(DIRECTIONS)]
    for name in sorted(groups):
        cells = []
        for key, _ in DIRECTIONS:
            vals = sorted(r[key] for r in groups[name] if isinstance(r.get(key), (int, float)))
            cells.append(f"{_x(statistics.median(vals))} / {_x(vals[0])}" if vals else "n/a")
        lines.append(f"| {name} | {len(groups[name])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> bool:
    """Replace the text between the markers in `path` by `text`; False (file untouched) without both markers."""
    with open(path) as fh:
        doc = fh.read()
    a, b = doc.find(BEGIN), doc.find(END)
    if a < 0 or b < 0 or b < a:
        return False
    new = doc[: a + len(BEGIN)] + "\n" + text + doc[b:]
    if new != doc:
        with open(path, "w") as fh:
            fh.write(new)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default=SWEEP, help=f"a sweep result (file name, path, or 'newest'; default {SWEEP})")
    ap.add_argument("--write", default="", help="a markdown file whose perf-table markers get the table")
    ap.add_argument("--by-class", action="store_true", help="the drawn shards' ratios by class instead")
    args = ap.parse_args(argv)
    path = resolve(args.sweep)
    with open(path) as fh:
        result = json.load(fh)
    if args.by_class:
        print(by_class(result), end="")
        return
    rel = os.path.relpath(path, os.path.join(RESULTS, "..", ".."))
    text = table(result, rel)
    print(text, end="")
    if args.write:
        if not write(args.write, text):
            print(f"{args.write}: no {BEGIN} ... {END} markers; nothing written", file=sys.stderr)
            raise SystemExit(1)
        print(f"wrote the table into {args.write}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""`python -m benchmarks <suite> [args]`: run one benchmark suite.

Suites: `sweep` (many drawn shard shapes against FBGEMM, `benchmarks/sweep.py`), `dispatch` (host time of jitted
calls, `benchmarks/dispatch.py`), `cpu_update` (the XLA path's update on the CPU as tables grow), `probe_repair`
(the default mode's offsets repair and id counts on the device, `benchmarks/probe_repair.py`). The older scripts (`bench_*.py`, `trace_*.py`) still run as files.
"""

from __future__ import annotations

import importlib
import sys

SUITES = {"sweep": "benchmarks.sweep", "dispatch": "benchmarks.dispatch", "cpu_update": "benchmarks.cpu_update",
          "probe_repair": "benchmarks.probe_repair"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(__doc__)
        print("suites:", ", ".join(SUITES))
        raise SystemExit(2)
    module = importlib.import_module(SUITES[argv[0]])
    module.main(argv[1:])


if __name__ == "__main__":
    main()

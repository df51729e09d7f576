"""The rows of ``bench/history/README.md``'s index, computed from the kept runs.

    python -m bench.history_index            # every RESULTS_*.md in bench/history
    python -m bench.history_index FILE...    # those files' rows (e.g. one just moved there)

Per run: its code and that commit's date (from git, where the checkout has it), the
machine (device and torch threads, from the report's header; ``_slow``/``_noisy``/... from
the name), the number of configurations, geometric means of acrobat on the models' plain
code (``acrobat-plain``; ``acrobat`` in runs before it existed) against DyNet's faster
strategy, the eager loop and the hand-batched version, DRNN large b64 hand / acrobat, and
the eager loop's TreeLSTM small b64 median in ms (a machine-speed reading).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import defaultdict

HISTORY = os.path.join(os.path.dirname(__file__), "history")
_ROW = re.compile(r"\| (\w+) \| (\w+) \| (\d+) \| ([\w-]+) \| ([\d.]+) \|")
_STATES = ("slow", "noisy", "nosettle", "check")


def medians(path: str) -> dict:
    """``{(model, size, batch): {system: median ms}}`` from a report's Times table."""
    rows: dict = defaultdict(dict)
    with open(path) as f:
        for line in f:
            m = _ROW.match(line)
            if m:
                rows[(m[1], m[2], int(m[3]))][m[4]] = float(m[5])
    return rows


def _geomean(ratios: list[float]) -> float | None:
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def speedups(rows: dict, system: str) -> dict[str, float | None]:
    """Geometric means of ``system``'s speedup over DyNet's best, eager and hand."""
    over: dict[str, list[float]] = {"dynet": [], "eager": [], "hand": []}
    for times in rows.values():
        if system not in times:
            continue
        dynet = [t for s, t in times.items() if s.startswith("dynet")]
        if dynet:
            over["dynet"].append(min(dynet) / times[system])
        for ref in ("eager", "hand"):
            if ref in times:
                over[ref].append(times[ref] / times[system])
    return {ref: _geomean(ratios) for ref, ratios in over.items()}


def _commit_date(commit: str) -> str:
    if not commit:
        return ""
    done = subprocess.run(
        ["git", "log", "-1", "--format=%cs", commit], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def row(path: str) -> str:
    """The index row of one kept report."""
    name = os.path.basename(path)
    with open(path) as f:
        header = next(line for line in f if line.startswith("torch "))
    commit = m.group(1) if (m := re.search(r"_([0-9a-f]{7})", name)) else ""
    threads = re.search(r"(\d+) torch threads", header).group(1)  # type: ignore[union-attr]
    device = re.search(r"device cuda \(([^)]*)\)", header)
    machine = (device.group(1).replace("NVIDIA ", "") if device else "CPU") + f", {threads} thr"
    states = [s for s in _STATES if f"_{s}" in name]
    if states:
        machine += f" ({', '.join(states)})"
    rows = medians(path)
    system = "acrobat-plain" if any("acrobat-plain" in t for t in rows.values()) else "acrobat"
    means = speedups(rows, system)
    drnn = rows.get(("drnn", "large", 64), {})
    eager = rows.get(("treelstm", "small", 64), {}).get("eager")
    cells = [
        f"`{name}`",
        commit or "—",
        _commit_date(commit) or "—",
        machine,
        str(len(rows)),
        *("—" if means[r] is None else f"{means[r]:.2f}x" for r in ("dynet", "eager", "hand")),
        f"{drnn['hand'] / drnn[system]:.2f}" if "hand" in drnn and system in drnn else "—",
        str(eager) if eager else "—",
    ]
    return "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> None:
    if not paths:
        paths = sorted(
            os.path.join(HISTORY, f) for f in os.listdir(HISTORY) if f.startswith("RESULTS_")
        )
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1:])

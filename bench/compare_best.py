"""Best of several ``compare.py`` runs: one table, the best figure of each system per row.

The issue's figures are "best of two" per cell (the VM's noise moves single runs by tens
of percent): run ``compare.py --json`` twice or more, with the same ``--only``, then

    python bench/compare_best.py run1.json run2.json

prints a Markdown table: each system's best figure (lowest time, memory and latency,
highest rate) and amesh's edge over Monarch (Monarch's figure over amesh's for times,
amesh's over Monarch's for rates), then the date and load average of each run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import compare  # this directory's compare.py (a script's directory is on sys.path)


def best(runs: list[dict[str, Any]], system: str, metric: dict[str, Any]) -> float | None:
    values = []
    for run in runs:
        figures = run["systems"].get(system, {}).get("metrics") or {}
        value = figures.get(metric["key"])
        if isinstance(value, int | float):
            values.append(float(value))
    if not values:
        return None
    return max(values) if metric["higher_is_better"] else min(values)


def fmt(value: float | None) -> str:
    return "n/a" if value is None else compare.fmt(value)


def table(runs: list[dict[str, Any]]) -> str:
    systems = list(runs[0]["systems"])
    lines = [
        "| metric | unit | " + " | ".join(systems) + " | amesh's edge over Monarch |",
        "|---|---|" + "---:|" * (len(systems) + 1),
    ]
    for metric in runs[0]["metrics"]:
        figures = {s: best(runs, s, metric) for s in systems}
        ours, theirs = figures.get("amesh"), figures.get("monarch")
        edge = ""
        if ours and theirs:
            ratio = ours / theirs if metric["higher_is_better"] else theirs / ours
            edge = f"{ratio:.2f}x"
        cells = " | ".join(fmt(figures[s]) for s in systems)
        lines.append(f"| {metric['label']} | {metric['unit']} | {cells} | {edge} |")
    lines.append("")
    lines += [f"- run of {r['date']}, load average {r['loadavg_before']} before" for r in runs]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="JSON files written by compare.py --json")
    args = p.parse_args()
    print(table([json.loads(path.read_text()) for path in args.runs]))


if __name__ == "__main__":
    main()

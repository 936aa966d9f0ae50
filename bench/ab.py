"""Old against new in one run: ``compare.py --only amesh`` alternated over checkouts.

Issue 37's rule for a change that must not regress: run the old and the new build in the
same run, alternating, pinned to one CPU, and compare medians. ::

    git worktree add /tmp/wt-old 4e3de25        # build its extension there
    .venv/bin/python bench/ab.py --rounds 9 /tmp/wt-old .

Each round runs ``bench/compare.py --only amesh --quick`` (this checkout's script) once
per checkout, in the order given, under ``taskset -c CPU`` with ``PYTHONPATH`` set to that
checkout's ``src``. The table gives each checkout's median per figure and, for every
checkout after the first, the ratio of its median to the first's (for a rate, the first's
over its own), so above 1 means slower than the first. The spread (min-max over rounds)
says how much one round's figure moves on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIGURES = {
    # key: (label, higher is better)
    "call_one_p50_us": ("call_one p50 (µs)", False),
    "pipelined_calls_per_s": ("pipelined (calls/s)", True),
    "call_16_p50_ms": ("call() to 16 p50 (ms)", False),
    "echo_16MiB_GBps": ("echo 16 MiB (GB/s)", True),
}


def run_once(root: Path, out: Path, cpu: str, quick: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    cmd = [sys.executable, str(HERE / "compare.py"), "--only", "amesh", "--json", str(out)]
    if quick:
        cmd.append("--quick")
    if cpu:
        cmd = ["taskset", "-c", cpu, *cmd]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    metrics = doc["systems"]["amesh"]["metrics"]
    return {k: float(metrics[k]) for k in FIGURES if isinstance(metrics.get(k), int | float)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="+", type=Path, help="checkouts of amesh (the first is the base)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu", default="0", help="taskset's CPU list ('' for no pinning)")
    p.add_argument("--full", action="store_true", help="compare.py's full plan, not --quick")
    p.add_argument("--json", type=Path, help="write every round's figures here")
    args = p.parse_args(argv)
    roots = [r.resolve() for r in args.roots]
    for root in roots:
        if not (root / "src" / "amesh").is_dir():
            p.error(f"{root} has no src/amesh")
    runs: dict[str, list[dict[str, float]]] = {str(r): [] for r in roots}
    with tempfile.TemporaryDirectory(prefix="amesh-ab-") as tmp:
        for i in range(args.rounds):
            for root in roots:
                figures = run_once(root, Path(tmp) / "run.json", args.cpu, not args.full)
                runs[str(root)].append(figures)
                shown = ", ".join(f"{k}={v:.4g}" for k, v in figures.items())
                print(f"[ab] round {i + 1}/{args.rounds} {root.name}: {shown}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    base = runs[str(roots[0])]
    print("| figure | " + " | ".join(r.name for r in roots) + " |")
    print("|---" * (len(roots) + 1) + "|")
    for key, (label, higher) in FIGURES.items():
        base_values = [f[key] for f in base if key in f]
        if not base_values:
            continue
        base_median = statistics.median(base_values)
        cells = []
        for root in roots:
            values = [f[key] for f in runs[str(root)] if key in f]
            median = statistics.median(values)
            cell = f"{median:.4g} ({min(values):.4g}-{max(values):.4g})"
            if root != roots[0]:
                ratio = base_median / median if higher else median / base_median
                cell += f", x{ratio:.3f}"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\n{args.rounds} rounds, alternated; x = slower than {roots[0].name} when above 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How amesh's source is laid out, in figures: issue 37's before and after.

Usage::

    .venv/bin/python scripts/structure_report.py               # this checkout
    .venv/bin/python scripts/structure_report.py --root /tmp/wt-base --json

``--root`` is a checkout of amesh (its ``src/amesh``, ``ext/`` and ``pyproject.toml``
are read there; it may be a ``git worktree`` of an older commit). What it prints:

- **packages**: Python files and lines (``wc -l``) per package under ``src/amesh``;
  ``amesh`` counts only the top-level modules, each subpackage its own folder with
  everything below it; then the C extension's files and lines in ``ext/``.
- **largest files** and **largest classes**: classes by lines (``class`` line to its
  last line), and by members: the methods defined in the class body plus its
  attributes (names assigned or annotated in the class body, and ``self.X`` assigned
  in its methods), each name once.
- **round trip**: one ``await mesh.ep.call(x)`` in one process. A child process runs
  the root's amesh (``PYTHONPATH=ROOT/src``) with ``amesh.run`` on streams
  (``AMESH_TRANSPORT_IMPL=stream``), an ``InProcessHost`` mesh of one worker (so the
  worker's runtime runs in the same thread) and an actor whose endpoint returns its
  argument. After ``--warmup`` calls, ``sys.setprofile`` is on from just before the
  ``await`` to just after it returns, for ``--rounds`` calls; of those, the call with
  the fewest events is reported (a heartbeat or a timer that lands in a call adds
  calls that are not the call's). Counted: the profiler's ``call`` events whose code
  lives in a file under the root's ``src/amesh`` (amesh's Python functions: each
  function entered, and each resumption of a coroutine or generator after it
  yielded, which the profiler also reports as a ``call``; calls into C and into other
  packages such as anyio or asyncio are not counted). ``modules``: how many distinct
  amesh modules those calls ran in; ``module changes``: how many times one counted
  call's module differs from the counted call before it.
- **layer contract ignores**: the ``ignore_imports`` of the contract with ``id =
  "layers"`` in ``pyproject.toml`` (and of all contracts together).
- **private reach-ins**: an import (at module level, in a function, or under
  ``TYPE_CHECKING``; relative or absolute; ``from P import _m`` where ``_m`` is a
  module counts as importing ``P._m``) of a module inside a subpackage ``P`` of
  amesh, other than ``P`` itself (its front door), by a module outside ``P``. E.g.
  ``from amesh._runtime._mailbox import X`` in ``amesh._model._endpoint``. A module of the
  ``amesh`` package itself (``amesh._identity``) is nobody's private module here: the
  top level is the shared ground. Per package: the files that reach in, the private
  modules reached, the import statements.
- **duplicates**: the pair count of ``duplicates --repo ROOT/src --most 200`` (the
  tool's first line).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOP = 10

#: the round trip's argument ``x``: an int goes as a plain payload (no pickling); a
#: tuple is pickled, which is what an argument of any other type costs
PAYLOADS: dict[str, object] = {"x = 1": 1, "x = (1, 2)": (1, 2)}


@dataclass
class ClassSize:
    name: str
    lines: int
    methods: int
    attributes: int

    @property
    def members(self) -> int:
        return self.methods + self.attributes


@dataclass
class Report:
    root: str
    commit: str
    packages: dict[str, dict[str, int]] = field(default_factory=dict)
    c_extension: dict[str, int] = field(default_factory=dict)
    largest_files: list[tuple[str, int]] = field(default_factory=list)
    classes_by_lines: list[dict[str, Any]] = field(default_factory=list)
    classes_by_members: list[dict[str, Any]] = field(default_factory=list)
    round_trip: dict[str, Any] = field(default_factory=dict)
    layer_ignores: dict[str, int] = field(default_factory=dict)
    reach_ins: dict[str, dict[str, int]] = field(default_factory=dict)
    duplicates_pairs: int | None = None


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(src: Path) -> list[Path]:
    return sorted(p for p in (src / "amesh").rglob("*.py") if "__pycache__" not in p.parts)


def line_count(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def packages_of(src: Path) -> set[str]:
    return {module_name(src, p) for p in (src / "amesh").rglob("__init__.py")}


def owning_package(module: str, packages: set[str], is_package: bool) -> str:
    """The innermost package that holds ``module`` (a package holds itself)."""
    name = module if is_package else module.rpartition(".")[0]
    while name not in packages:
        name = name.rpartition(".")[0]
    return name


def measure_packages(src: Path, report: Report) -> None:
    packages = packages_of(src)
    sizes: list[tuple[str, int]] = []
    for path in python_files(src):
        mod = module_name(src, path)
        pkg = owning_package(mod, packages, path.name == "__init__.py")
        # a subpackage counts with everything below it: its top-level folder under amesh
        top = ".".join(pkg.split(".")[:2])
        lines = line_count(path)
        entry = report.packages.setdefault(top, {"files": 0, "lines": 0})
        entry["files"] += 1
        entry["lines"] += lines
        sizes.append((str(path.relative_to(src)), lines))
    report.packages = dict(sorted(report.packages.items()))
    report.largest_files = sorted(sizes, key=lambda s: -s[1])[:TOP]


def measure_c(root: Path, report: Report) -> None:
    files = sorted(p for p in (root / "ext").rglob("*") if p.suffix in (".c", ".h"))
    report.c_extension = {"files": len(files), "lines": sum(line_count(p) for p in files)}


def class_size(node: ast.ClassDef, qualname: str) -> ClassSize:
    methods: set[str] = set()
    attributes: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            methods.add(item.name)
            for sub in ast.walk(item):
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if (
                            isinstance(el, ast.Attribute)
                            and isinstance(el.value, ast.Name)
                            and el.value.id == "self"
                        ):
                            attributes.add(el.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    attributes -= methods
    lines = (node.end_lineno or node.lineno) - node.lineno + 1
    return ClassSize(qualname, lines, len(methods), len(attributes))


def measure_classes(src: Path, report: Report) -> None:
    sizes: list[ClassSize] = []
    for path in python_files(src):
        tree = ast.parse(path.read_text(), str(path))
        mod = module_name(src, path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                sizes.append(class_size(node, f"{mod}.{node.name}"))

    def row(c: ClassSize) -> dict[str, Any]:
        return {**asdict(c), "members": c.members}

    report.classes_by_lines = [row(c) for c in sorted(sizes, key=lambda c: -c.lines)[:TOP]]
    report.classes_by_members = [row(c) for c in sorted(sizes, key=lambda c: -c.members)[:TOP]]


def imported_modules(
    node: ast.Import | ast.ImportFrom, mod: str, is_package: bool, modules: set[str]
) -> list[str]:
    """The amesh modules one import statement in module ``mod`` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.split(".") if is_package else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    return found or [target]


def measure_reach_ins(src: Path, report: Report) -> None:
    packages = packages_of(src)
    modules = {module_name(src, p) for p in python_files(src)}
    files: dict[str, set[str]] = {}
    targets: dict[str, set[str]] = {}
    statements: dict[str, int] = {}
    for path in python_files(src):
        mod = module_name(src, path)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            reached = False
            for target in imported_modules(node, mod, is_package, modules):
                if target not in modules or target in packages:
                    continue
                pkg = owning_package(target, packages, False)
                if pkg == "amesh" or mod == pkg or mod.startswith(pkg + "."):
                    continue
                files.setdefault(pkg, set()).add(mod)
                targets.setdefault(pkg, set()).add(target)
                if not reached:
                    statements[pkg] = statements.get(pkg, 0) + 1
                    reached = True
    report.reach_ins = {
        pkg: {
            "files": len(files[pkg]),
            "private_modules": len(targets[pkg]),
            "imports": statements[pkg],
        }
        for pkg in sorted(files)
    }
    # a file that reaches into two packages is one file in the total
    report.reach_ins["total"] = {
        "files": len(set().union(*files.values())),
        "private_modules": sum(len(t) for t in targets.values()),
        "imports": sum(statements.values()),
    }


def measure_layer_ignores(root: Path, report: Report) -> None:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    layers = [c for c in contracts if c.get("id") == "layers"]
    report.layer_ignores = {
        "layers": sum(len(c.get("ignore_imports", [])) for c in layers),
        "all contracts": sum(len(c.get("ignore_imports", [])) for c in contracts),
    }


def measure_duplicates(root: Path, report: Report) -> None:
    tool = shutil.which("duplicates")
    if tool is None:
        return
    out = subprocess.run(
        [tool, "--repo", str(root / "src"), "--most", "200", "--seconds", "120"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    first = out.splitlines()[0] if out else ""
    m = re.match(r"(\d+) pairs?", first)
    report.duplicates_pairs = int(m.group(1)) if m else 0 if first.startswith("no ") else None


def measure_round_trip(root: Path, report: Report, warmup: int, rounds: int) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(root / "src"),
        "AMESH_TRANSPORT_IMPL": "stream",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--trace-child", str(warmup), str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        report.round_trip = {"error": proc.stderr.strip().splitlines()[-1:]}
        return
    report.round_trip = json.loads(proc.stdout)


def trace_child(warmup: int, rounds: int) -> None:
    """In the child: trace ``rounds`` calls after ``warmup`` and print the fewest."""
    import amesh
    from amesh.testing import InProcessHost

    pkgdir = str(Path(amesh.__file__).parent) + os.sep
    srcdir = Path(pkgdir).parent

    class Echo(amesh.Actor):
        @amesh.endpoint
        async def echo(self, x: object) -> object:
            return x

    async def main() -> dict[str, list[list[str]]]:
        traces: dict[str, list[list[str]]] = {}
        async with amesh.ProcMesh({"procs": 1}, host=InProcessHost()) as procs:
            mesh = await procs.spawn("echo", Echo)
            for label, x in PAYLOADS.items():
                for _ in range(warmup):
                    await mesh.echo.call(x)
                for _ in range(rounds):
                    seen: list[str] = []

                    def profile(frame: Any, event: str, arg: Any, seen: list[str] = seen) -> None:
                        if event == "call" and frame.f_code.co_filename.startswith(pkgdir):
                            seen.append(frame.f_code.co_filename)

                    sys.setprofile(profile)
                    await mesh.echo.call(x)
                    sys.setprofile(None)
                    traces.setdefault(label, []).append(seen)
        return traces

    result: dict[str, dict[str, Any]] = {}
    for label, runs in amesh.run(main).items():
        fewest = min(runs, key=len)
        mods = [module_name(srcdir, Path(f)) for f in fewest]
        result[label] = {
            "python_calls": len(mods),
            "modules": len(set(mods)),
            "module_changes": sum(1 for a, b in itertools.pairwise(mods) if a != b),
            "calls_per_round": [len(t) for t in runs],
            "module_list": sorted(set(mods)),
        }
    print(json.dumps(result))


def git_commit(root: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "?"


def measure(root: Path, warmup: int, rounds: int, trace: bool) -> Report:
    src = root / "src"
    report = Report(str(root), git_commit(root))
    measure_packages(src, report)
    measure_c(root, report)
    measure_classes(src, report)
    if trace:
        measure_round_trip(root, report, warmup, rounds)
    measure_layer_ignores(root, report)
    measure_reach_ins(src, report)
    measure_duplicates(root, report)
    return report


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title]
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(r: Report) -> str:
    total_files = sum(p["files"] for p in r.packages.values())
    total_lines = sum(p["lines"] for p in r.packages.values())
    pkg_rows: list[list[Any]] = [[k, v["files"], v["lines"]] for k, v in r.packages.items()]
    pkg_rows.append(["total (src/amesh)", total_files, total_lines])
    pkg_rows.append(["C extension (ext/)", r.c_extension["files"], r.c_extension["lines"]])
    rt = r.round_trip
    if not rt:
        rt_rows: list[list[Any]] = [["not measured (--no-trace)", "", "", "", ""]]
    elif "error" in rt:
        rt_rows = [["failed: " + " ".join(rt["error"]), "", "", "", ""]]
    else:
        rt_rows = [
            [
                label,
                v["python_calls"],
                v["modules"],
                v["module_changes"],
                " ".join(map(str, v["calls_per_round"])),
            ]
            for label, v in rt.items()
        ]
    sections = [
        f"amesh structure at {r.commit} ({r.root})",
        table("Packages", ["package", "files", "lines"], pkg_rows),
        table("Largest files", ["file", "lines"], [list(f) for f in r.largest_files]),
        table(
            "Largest classes by lines",
            ["class", "lines", "methods", "attributes"],
            [[c["name"], c["lines"], c["methods"], c["attributes"]] for c in r.classes_by_lines],
        ),
        table(
            "Largest classes by members (methods + attributes)",
            ["class", "members", "methods", "attributes", "lines"],
            [
                [c["name"], c["members"], c["methods"], c["attributes"], c["lines"]]
                for c in r.classes_by_members
            ],
        ),
        table(
            "Round trip: one await mesh.ep.call(x), in one process (Python calls into amesh)",
            ["argument", "calls", "modules", "module changes", "calls in each traced round"],
            rt_rows,
        ),
        table(
            "Layer contract (pyproject.toml)",
            ["ignore_imports", "count"],
            [[k, v] for k, v in r.layer_ignores.items()],
        ),
        table(
            "Private reach-ins across packages",
            ["package reached into", "files", "private modules", "imports"],
            [[k, v["files"], v["private_modules"], v["imports"]] for k, v in r.reach_ins.items()],
        ),
        table(
            "Duplicates (duplicates --repo src --most 200)",
            ["what", "count"],
            [
                [
                    "pairs",
                    "duplicates not on PATH" if r.duplicates_pairs is None else r.duplicates_pairs,
                ]
            ],
        ),
    ]
    return "\n\n".join(sections)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--trace-child":
        trace_child(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the amesh checkout to measure (default: this one)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--warmup", type=int, default=200, help="calls before tracing")
    parser.add_argument("--rounds", type=int, default=5, help="traced calls (fewest reported)")
    parser.add_argument(
        "--no-trace", action="store_true", help="skip the round trip (no amesh run)"
    )
    args = parser.parse_args()
    report = measure(args.root.resolve(), args.warmup, args.rounds, not args.no_trace)
    print(json.dumps(asdict(report), indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()

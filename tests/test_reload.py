"""Hot reload: replacing an actor mesh on running processes, and ``sync_code``."""

from __future__ import annotations

import importlib
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import ActorError, ProcMesh
from amesh._reload import project_sources

from .actors import Counter
from .reload_actors import Importer, Successor

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


async def test_replace_keeps_processes_and_other_actor_meshes(tmp_path: Path) -> None:
    env = {"AMESH_TEST_CLEANUP_DIR": str(tmp_path)}
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, env=env) as procs:
            other = await procs.spawn("other", Counter, 5)
            await other.incr.call(1)
            old = await procs.spawn("c", Counter, 1)
            assert (await old.incr.call(2)).values() == [3, 3]
            pids = procs.pids
            with pytest.raises(ValueError, match="already has an actor mesh named 'c'"):
                await procs.spawn("c", Successor)

            new = await procs.spawn("c", Successor, 10, replace=True)

            # the old actors were stopped: their __cleanup__ ran, in the same processes
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
                f"cleanup-{pid}" for pid in pids
            )
            assert {p.read_text() for p in tmp_path.iterdir()} == {"3"}
            # the new ones took the old ones' state over (__reload__)
            assert (await new.state.call()).values() == [(13, "Counter"), (13, "Counter")]
            assert procs.pids == pids
            assert (await new.pid.call()).values() == pids
            assert (await other.get.call()).values() == [6, 6]
            # issue 36, item 19: not an ActorError (no endpoint ran, none raised)
            with pytest.raises(LookupError) as info:
                await old.get.call()
            assert not isinstance(info.value, ActorError)
            assert re.fullmatch(
                r"c\.get at rank [01]: actor mesh 'c' was replaced \(use the ActorMesh that "
                r"spawn\(\.\.\., replace=True\) returned\)",
                str(info.value),
            ), info.value
            found = await procs.actor_mesh("c")
            assert found.actor_class is Successor and found.key == new.key

            await new.stop()
            with pytest.raises(
                LookupError,
                match=r"^c\.state at rank [01]: actor mesh 'c' was stopped$",
            ):
                await new.state.call()


async def test_replace_a_mesh_of_a_slice_without_reload_hook() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            old = await procs.spawn("s", Successor, 7)
            new = await procs.slice(procs=1).spawn("s", Counter, 2, replace=True)
            assert (await new.incr.call()).values() == [3]  # Counter has no __reload__
            assert (await new.pid.call()).values() == procs.pids[1:]
            with pytest.raises(LookupError, match="was replaced"):
                await old.slice(procs=0).state.call()
            # a Successor replacing it takes over where both run
            again = await procs.spawn("s", Successor, 1, replace=True)
            assert (await again.state.call()).values() == [(1, None), (4, "Counter")]


_SCRIPT = """
import os
import amesh
from amesh import Actor, endpoint

class Greeter(Actor):
    def __init__(self, name):
        self.name = name

    @endpoint
    def hello(self):
        return f"hello {self.name}"

    @endpoint
    def pid(self):
        return os.getpid()

procs = amesh.ProcMesh({"procs": 2}).get()
old = procs.spawn("greeter", Greeter, "ann").get()
print("before", old.hello.call().get().values())
pids = old.pid.call().get().values()

# the cell that defines it runs again, edited
class Greeter(Actor):
    def __init__(self, name):
        self.name = name.upper()

    @endpoint
    def hello(self):
        return f"bonjour {self.name}"

    @endpoint
    def pid(self):
        return os.getpid()

new = procs.spawn("greeter", Greeter, "ann", replace=True).get()
print("after", new.hello.call().get().values())
print("same pids", new.pid.call().get().values() == pids == procs.pids)
try:
    old.hello.call().get()
except LookupError as exc:
    print("old handle", type(exc).__name__, "was replaced" in str(exc))
procs.stop().get()
"""


async def test_a_class_redefined_in_main_gets_the_new_behaviour(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(_SCRIPT)
    with anyio.fail_after(120):
        out = await anyio.run_process([sys.executable, str(script)], cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert lines == [
        "before ['hello ann', 'hello ann']",
        "after ['bonjour ANN', 'bonjour ANN']",
        "same pids True",
        "old handle LookupError True",
    ]


_V1 = """
import amesh

VERSION = 1
ONLY_IN_V1 = "kept"


class Worker(amesh.Actor):
    @amesh.endpoint
    def version(self):
        return "v1", VERSION, ONLY_IN_V1
"""

_V2 = """
import amesh

VERSION = 2


class Worker(amesh.Actor):
    @amesh.endpoint
    def version(self):
        return "v2", VERSION, ONLY_IN_V1


def boom():
    raise ValueError("boom in v2")
"""


@pytest.fixture
def module_name() -> Iterator[str]:
    """A fresh module name, forgotten by the controller afterwards."""
    name = f"reload_mod_{uuid.uuid4().hex[:8]}"
    yield name
    sys.modules.pop(name, None)


async def test_sync_code_reloads_changed_modules_in_place(
    tmp_path: Path, module_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / f"{module_name}.py"
    source.write_text(_V1)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get the controller's path
    mod = importlib.import_module(module_name)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            old = await procs.spawn("w", mod.Worker)
            assert (await old.version.call()).values() == [("v1", 1, "kept")] * 2
            assert (await procs.sync_code(paths=[tmp_path])).values() == [[], []]

            source.write_text(_V2)
            reloaded = await procs.sync_code(paths=[tmp_path])
            assert reloaded.values() == [[module_name], [module_name]]
            # as importlib.reload: the old class's code, the module's new globals,
            # and a name the new source no longer defines is still there
            assert (await old.version.call()).values() == [("v1", 2, "kept")] * 2
            new = await procs.spawn("w", mod.Worker, replace=True)
            assert (await new.version.call()).values() == [("v2", 2, "kept")] * 2
            assert (await procs.sync_code(paths=[tmp_path])).values() == [[], []]

            source.write_text(_V2 + "\ndef broken(:\n")
            with pytest.raises(ActorError, match=f"reloading module '{module_name}'"):
                await procs.sync_code(paths=[tmp_path])
            assert (await new.version.call()).values() == [("v2", 2, "kept")] * 2


async def test_sync_code_sends_the_source_where_the_file_differs(
    tmp_path: Path, module_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose file is another (another host's disk) runs the sent source, and
    its tracebacks show it; its file is left as it was."""
    here, there = tmp_path / "controller", tmp_path / "worker"
    here.mkdir()
    there.mkdir()
    (here / f"{module_name}.py").write_text(_V2)
    theirs = there / f"{module_name}.py"
    theirs.write_text(_V1)
    monkeypatch.syspath_prepend(str(here))
    importlib.import_module(module_name)
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            imp = await procs.spawn("imp", Importer)
            assert await imp.load_from.call_one(str(there), module_name) == str(theirs)
            assert await imp.get.call_one(module_name, "VERSION") == 1

            assert (await procs.sync_code(paths=[here])).values() == [[module_name]]
            assert await imp.get.call_one(module_name, "VERSION") == 2
            assert theirs.read_text() == _V1
            with pytest.raises(ActorError) as info:
                await imp.run.call_one(module_name, "boom")
            assert str(theirs) in info.value.traceback
            assert 'raise ValueError("boom in v2")' in info.value.traceback
            assert (await procs.sync_code(paths=[here])).values() == [[]]


def test_project_sources_leave_out_amesh_and_the_environment() -> None:
    package = Path(amesh.__file__).resolve().parent
    found = project_sources([package.parent, Path(sys.prefix)])
    assert not [name for name in found if name == "amesh" or name.startswith("amesh.")]
    assert not [name for name in found if name.split(".")[0] in ("anyio", "msgspec")]
    assert "tests.reload_actors" in project_sources([ROOT / "tests"])


def test_moving_to_a_new_tree_repoints_modules_and_reloads_the_changed_ones(
    tmp_path: Path,
) -> None:
    """CodeTracker.move_root (what ProcMesh.sync runs in each worker): modules of the
    old tree (a package and its submodule) name the new one; the changed one is
    reloaded; a module whose file the new tree lacks stays; the import path moves."""
    from amesh._reload import CodeTracker

    pkg = f"movedpkg_{uuid.uuid4().hex[:8]}"
    old, new = tmp_path / "old", tmp_path / "new"
    for tree, value in ((old, 1), (new, 2)):
        (tree / pkg).mkdir(parents=True)
        (tree / pkg / "__init__.py").write_text("")
        (tree / pkg / "same.py").write_text("KEPT = True\n")
        (tree / pkg / "changed.py").write_text(f"VALUE = {value}\n")
    (old / pkg / "gone.py").write_text("GONE = True\n")
    (new / pkg / "added.py").write_text("ADDED = True\n")
    sys.path.insert(0, str(old))
    try:
        same = importlib.import_module(f"{pkg}.same")
        changed = importlib.import_module(f"{pkg}.changed")
        gone = importlib.import_module(f"{pkg}.gone")
        reloaded = CodeTracker().move_root(str(old), str(new))
        assert reloaded == [f"{pkg}.changed"]
        assert changed.VALUE == 2 and changed.__file__ == str(new / pkg / "changed.py")
        assert same.__file__ == str(new / pkg / "same.py")
        assert gone.__file__ == str(old / pkg / "gone.py")  # (nothing to move it to)
        assert sys.modules[pkg].__path__ == [str(new / pkg)]
        assert str(new) in sys.path and str(old) not in sys.path
        assert importlib.import_module(f"{pkg}.added").ADDED  # found in the new tree
        assert CodeTracker().move_root(str(new), str(new)) == []
    finally:
        sys.path[:] = [p for p in sys.path if p not in (str(old), str(new))]
        for name in [m for m in sys.modules if m == pkg or m.startswith(f"{pkg}.")]:
            del sys.modules[name]

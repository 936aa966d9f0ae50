"""Hot reload of a project's modules in running workers (:meth:`ProcMesh.sync_code`).

The controller (:func:`project_sources`) reads the source of each loaded module of
its project; each worker (:class:`CodeTracker`) says which source it runs for the same
module names and what its own file holds (:meth:`CodeTracker.versions`); the
controller (:func:`updates_for`) sends each worker the modules it runs an older
version of, with the source only where the worker's file differs (another host); the
worker re-executes them (:meth:`CodeTracker.load`).

Re-executing is what :func:`importlib.reload` does: the module's code runs again in
the same module object, so its names are rebound to new objects, names the new source
no longer defines stay, and objects made before (instances, classes that other
modules imported by name) keep the old code. The code is compiled from the source
itself, never from a cached ``.pyc``.

Standard library only: the controller's and the worker's sides live on either side
of the agent (:mod:`amesh._model._process_actor`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "CodeTracker",
    "Update",
    "moved_path",
    "project_sources",
    "source_hash",
    "updates_for",
]

#: ``(module name, hash of its new source, the source when the worker's file differs)``
Update = tuple[str, str, bytes | None]
#: Modules that are never reloaded: the running script, in the controller and workers.
_MAINS = ("__main__", "__mp_main__")


def source_hash(data: bytes) -> str:
    """The content hash that the two sides compare."""
    return hashlib.sha256(data).hexdigest()


def _source_file(module: ModuleType | None) -> str | None:
    """The ``.py`` file that ``module`` was loaded from, if any."""
    path = getattr(module, "__file__", None)
    return path if isinstance(path, str) and path.endswith(".py") else None


def _not_project() -> list[Path]:
    """Folders whose modules are never a project's: the interpreter's and the
    environment's (site-packages), and amesh itself."""
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    return [Path(p).resolve() for p in prefixes] + [Path(__file__).resolve().parent]


def project_sources(roots: Iterable[str | os.PathLike[str]] | None = None) -> dict[str, bytes]:
    """The source of each loaded module whose file is under ``roots`` (by default the
    current directory), by module name, in import order.

    Not the running script (``__main__``), nor modules of the environment (under
    ``sys.prefix``, in a ``site-packages`` or ``dist-packages`` folder) or of amesh.
    """
    under = [Path(r).resolve() for r in (roots if roots is not None else [os.getcwd()])]
    skip = _not_project()
    found: dict[str, bytes] = {}
    for name, module in list(sys.modules.items()):
        path = _source_file(module)
        if path is None or name in _MAINS:
            continue
        file = Path(path).resolve()
        if not any(file.is_relative_to(root) for root in under):
            continue
        if any(file.is_relative_to(s) for s in skip) or {"site-packages", "dist-packages"} & set(
            file.parts
        ):
            continue
        try:
            found[name] = file.read_bytes()
        except OSError:  # deleted since it was imported: nothing to push
            continue
    return found


def updates_for(sources: dict[str, bytes], versions: dict[str, tuple[str, str]]) -> list[Update]:
    """What a worker that reported ``versions`` (see :meth:`CodeTracker.versions`)
    needs of the controller's ``sources``."""
    updates: list[Update] = []
    for name, (running, on_disk) in versions.items():
        data = sources.get(name)
        if data is None:
            continue
        digest = source_hash(data)
        if running != digest:
            updates.append((name, digest, None if on_disk == digest else data))
    return updates


class CodeTracker:
    """A worker's side: which source each module runs, and reloading them.

    A module reloaded here runs a known source. For one imported the usual way, the
    worker knows only that a file not modified since the worker started is what it
    imported; a file modified since may have changed after the import, so it counts
    as unknown and is reloaded once (an extra reload at worst).
    """

    def __init__(self) -> None:
        self._started = time.time_ns()
        #: hash of the source each module runs, for those reloaded here
        self._running: dict[str, str] = {}

    def versions(self, names: Sequence[str]) -> dict[str, tuple[str, str]]:
        """``{name: (hash of the source it runs, hash of its file now)}`` for the
        modules of ``names`` loaded here from a ``.py`` file; ``""`` for unknown."""
        found: dict[str, tuple[str, str]] = {}
        for name in names:
            path = _source_file(sys.modules.get(name))
            if path is None or name in _MAINS:
                continue
            try:
                on_disk = source_hash(Path(path).read_bytes())
                unchanged = os.stat(path).st_mtime_ns < self._started
            except OSError:
                on_disk, unchanged = "", False
            running = self._running.get(name)
            if running is None:
                running = on_disk if unchanged else ""
            found[name] = (running, on_disk)
        return found

    def load(self, updates: Sequence[Update]) -> list[str]:
        """Re-execute the modules of ``updates``, from the source sent or else from
        their file, those that entered ``sys.modules`` last first: a module imported
        while another one was being imported (its dependency) is reloaded before it,
        so that ``from dependency import name`` there gets the new object. Returns
        their names, in that order.

        Raises:
            ImportError: a module's new source failed to compile or to run (those
                before it in the order stay reloaded).
        """
        order = {name: i for i, name in enumerate(sys.modules)}
        todo = sorted(
            (u for u in updates if u[0] in order), key=lambda u: order[u[0]], reverse=True
        )
        done = []
        for name, _, sent in todo:
            module = sys.modules[name]
            path = _source_file(module)
            if path is None:
                continue
            try:
                data = sent if sent is not None else Path(path).read_bytes()
                _execute(module, path, data, sent is not None)
            except Exception as exc:
                raise ImportError(
                    f"reloading module {name!r} from {path}: {type(exc).__name__}: {exc}",
                    name=name,
                    path=path,
                ) from exc
            self._running[name] = source_hash(data)
            done.append(name)
        return done

    def move_root(self, old: str, new: str) -> list[str]:
        """Move this process from workspace tree ``old`` to tree ``new`` (both on this
        host, made whole and never changed after): its import path, the ``PYTHONPATH``
        its children get, its working directory, and each module imported from
        ``old`` (its ``__file__``, a package's ``__path__``) now name ``new``; those
        whose source differs in ``new`` are reloaded (as :meth:`load` does). A module
        whose file ``new`` lacks stays as it is, naming ``old``.

        Returns:
            The names of the modules reloaded.

        Raises:
            ImportError: a module's new source failed to compile or to run.
        """
        old, new = os.path.realpath(old), os.path.realpath(new)
        if old == new:
            return []
        sys.path[:] = [moved_path(p, old, new) for p in sys.path]
        parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if any(p for p in parts):
            os.environ["PYTHONPATH"] = os.pathsep.join(moved_path(p, old, new) for p in parts)
        cwd = os.getcwd()
        if moved_path(cwd, old, new) != cwd:
            os.chdir(moved_path(cwd, old, new))
        updates: list[Update] = []
        for name, module in list(sys.modules.items()):
            update = self._move_module(name, module, old, new)
            if update is not None:
                updates.append(update)
        importlib.invalidate_caches()  # (finders of the old tree's folders cached listings)
        return self.load(updates)

    def _move_module(self, name: str, module: ModuleType, old: str, new: str) -> Update | None:
        """Point ``module`` at its file in tree ``new``; the update that reloads it,
        if its source there is not what it runs."""
        path = _source_file(module)
        if path is None:
            return None
        moved = moved_path(path, old, new)
        if moved == path or not os.path.isfile(moved):
            return None
        try:
            running = self._running.get(name) or source_hash(Path(path).read_bytes())
            data = Path(moved).read_bytes()
        except OSError:
            return None
        module.__file__ = moved
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.origin == path:
            spec.origin = moved
            if spec.submodule_search_locations is not None:
                spec.submodule_search_locations[:] = [
                    moved_path(p, old, new) for p in spec.submodule_search_locations
                ]
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [moved_path(p, old, new) for p in search]
        digest = source_hash(data)
        self._running[name] = running
        if name in _MAINS or digest == running:
            return None
        return (name, digest, None)


def moved_path(path: str, old: str, new: str) -> str:
    """``path``, under folder ``old`` (its real path), as the same path under ``new``;
    any other path as it is."""
    if not path:
        return path
    real = os.path.realpath(path)
    if real == old:
        return new
    if real.startswith(old + os.sep):
        return new + real[len(old) :]
    return path


def _execute(module: ModuleType, path: str, data: bytes, sent: bool) -> None:
    """Run source ``data`` again in ``module``, as code of file ``path``.

    ``sent``: the file here holds another source, so tracebacks must show the lines
    of this one (``linecache``).
    """
    code = compile(data, path, "exec", dont_inherit=True)
    linecache.cache.pop(path, None)
    if sent:
        text = importlib.util.decode_source(data)
        # no modification time: linecache.checkcache keeps the entry
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
    exec(code, module.__dict__)

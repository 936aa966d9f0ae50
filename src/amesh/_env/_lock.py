"""The lock: an environment's dependencies resolved, with hashes, for one Python and
platform; and the environment's identity, the hash of its settings and its lock.

The lock is a requirements file (``pip`` and ``uv pip install -r`` read it as it is)
stored next to the environment file as ``<stem>.lock``. A header of comments says what
it was made for::

    # amesh lock, format 1
    # env: titan
    # python: 3.11
    # platform: linux-x86_64
    # amesh: 0.1.0
    # inputs: 2f6a...   (sha256 of what was resolved: a change makes the lock stale)
    tqdm==4.67.1 \\
        --hash=sha256:...

``uv pip compile`` resolves, for the controller's Python minor version and platform by
default: the hosts run what the controller runs. With ``amesh`` (the default) the
lock holds amesh's own runtime requirements too, pinned to the versions this
controller runs (a worker and its controller then pickle with the same cloudpickle
and speak with the same msgspec), so that the hosts need nothing but a Python.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from ._base import EnvError, cache_dir
from ._file import EnvSpec, canonical
from ._specs import python_satisfies, requirement_name

__all__ = [
    "LOCK_FORMAT",
    "Lock",
    "Locked",
    "amesh_requirements",
    "env_hash",
    "lock_inputs",
    "lock_path",
    "read_lock",
    "resolve",
    "this_platform",
    "this_python",
]

#: the newest format of a lock this amesh reads
LOCK_FORMAT = 1
_HEADER = f"# amesh lock, format {LOCK_FORMAT}"
_FIELDS = ("env", "python", "platform", "amesh", "inputs")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)\s*(?:;\s*(.+))?")
#: a resolve this long is stuck (uv waits on the index with deadlines of its own)
_RESOLVE_TIMEOUT = 600.0


class Locked(msgspec.Struct, frozen=True):
    """One requirement of a lock, pinned.

    Attributes:
        name: the project's normalised name.
        version: its exact version.
        hashes: the sha256 (hex) of each of its files that the lock accepts.
        marker: the PEP 508 marker it holds under ("" for always).
    """

    name: str
    version: str
    hashes: tuple[str, ...]
    marker: str = ""


class Lock(msgspec.Struct, frozen=True, kw_only=True):
    """An environment's dependencies, resolved.

    Attributes:
        env: the environment's name.
        python: the Python minor version resolved for (``"3.11"``).
        platform: the platform resolved for (``sysconfig.get_platform()``).
        amesh: the amesh version whose requirements it holds ("": none).
        inputs: sha256 of what was resolved: the dependencies, amesh's pins, the
            Python and the platform. A lock whose inputs differ from the file's is stale.
        requirements: the pinned requirements, by name.
    """

    env: str
    python: str
    platform: str
    amesh: str
    inputs: str
    requirements: tuple[Locked, ...]

    def text(self) -> str:
        """The lock file's text (:meth:`parse` reads it back)."""
        out = [_HEADER, *(f"# {key}: {getattr(self, key) or '-'}" for key in _FIELDS)]
        for req in self.requirements:
            line = f"{req.name}=={req.version}" + (f" ; {req.marker}" if req.marker else "")
            out.append(" \\\n".join([line, *(f"    --hash=sha256:{h}" for h in req.hashes)]))
        return "\n".join(out) + "\n"

    @classmethod
    def parse(cls, text: str, file: str = "<lock>") -> Lock:
        """A lock from its file's text.

        Raises:
            EnvError: not a lock this amesh reads (the message names the file and line).
        """
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# amesh lock, format "):
            raise EnvError(f"{file}:1: not an amesh lock (no '{_HEADER}' header)")
        fmt = lines[0].removeprefix("# amesh lock, format ")
        if not fmt.isdigit() or not 1 <= int(fmt) <= LOCK_FORMAT:
            raise EnvError(f"{file}:1: a lock of format {fmt}: this amesh reads {LOCK_FORMAT}")
        header: dict[str, str] = {}
        for number, key in enumerate(_FIELDS, 2):
            line = lines[number - 1] if number <= len(lines) else ""
            if not line.startswith(f"# {key}: "):
                raise EnvError(f"{file}:{number}: expected '# {key}: ...'")
            value = line.removeprefix(f"# {key}: ")
            header[key] = "" if value == "-" else value
        body = "\n".join(lines[len(_FIELDS) + 1 :])
        reqs = [_locked(entry, file) for entry in _entries(body)]
        return cls(**header, requirements=tuple(reqs))


def _entries(body: str) -> list[str]:
    """The requirement entries of a requirements file's ``body``, continuation lines
    joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line:
            out.append(line)
    return out


def _locked(entry: str, file: str) -> Locked:
    words = entry.split(" --hash=")
    found = _PIN.fullmatch(words[0].strip())
    if not found:
        raise EnvError(
            f"{file}: {words[0].strip()!r} is not pinned as name==version: a lock holds "
            "requirements from an index or --find-links only"
        )
    hashes = []
    for word in words[1:]:
        algo, _, digest = word.strip().partition(":")
        if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise EnvError(f"{file}: {found.group(1)}: expected --hash=sha256:<64 hex digits>")
        hashes.append(digest)
    if not hashes:
        raise EnvError(f"{file}: {found.group(1)} has no --hash: a lock pins files by hash")
    return Locked(
        requirement_name(found.group(1)), found.group(3), tuple(hashes), found.group(4) or ""
    )


def lock_path(spec_file: str | Path) -> Path:
    """Where the lock of the environment file ``spec_file`` is: beside it, ``<stem>.lock``."""
    path = Path(spec_file)
    return path.with_name(path.stem + ".lock")


def read_lock(path: str | Path) -> Lock | None:
    """The lock at ``path``; None if there is none.

    Raises:
        EnvError: it is not a lock this amesh reads.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise EnvError(f"{path}: cannot read the lock: {exc}") from None
    return Lock.parse(text, str(path))


def this_python() -> str:
    """This interpreter's minor version, ``"3.11"``."""
    return "{}.{}".format(*sys.version_info[:2])


def this_platform() -> str:
    """This machine's platform as the lock records it (``linux-x86_64``)."""
    return sysconfig.get_platform()


def amesh_version() -> str:
    """The version of the amesh this controller runs."""
    import importlib.metadata

    return importlib.metadata.version("amesh")


def amesh_requirements() -> list[str]:
    """amesh's own runtime requirements (not its extras'), each pinned to the version
    this controller runs where it is installed (markers kept)."""
    import importlib.metadata  # (9 ms: not for every `import amesh`)

    out = []
    for text in importlib.metadata.requires("amesh") or []:
        spec, _, marker = text.partition(";")
        if "extra" in marker:
            continue
        name = requirement_name(spec)
        try:
            pin = f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            pin = spec.strip()
        out.append(pin + (f" ; {marker.strip()}" if marker.strip() else ""))
    return out


def lock_inputs(spec: EnvSpec, python: str, platform: str, amesh: Sequence[str]) -> str:
    """sha256 of what a resolve of ``spec`` takes: a lock made from other inputs is stale."""
    data = {
        "dependencies": list(spec.dependencies),
        "amesh": list(amesh),
        "python": python,
        "platform": platform,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _uv() -> str:
    try:
        import uv
    except ImportError:
        raise EnvError("locking an environment needs uv: pip install 'amesh[env]'") from None
    return str(uv.find_uv_bin())


def resolve(
    spec: EnvSpec,
    *,
    include_amesh: bool = True,
    find_links: Sequence[str | Path] = (),
    no_index: bool = False,
) -> Lock:
    """Resolve ``spec``'s dependencies (with amesh's, unless not ``include_amesh``)
    into a lock for this controller's Python minor version and platform.

    Args:
        spec: the environment.
        include_amesh: lock amesh's own runtime requirements too (pinned to this
            controller's versions), for hosts that have nothing but a Python.
        find_links: directories (or pages) of distributions to resolve from, besides
            the index.
        no_index: resolve from ``find_links`` only.

    Returns:
        The lock (not written: see :func:`amesh._env.lock_env`).

    Raises:
        EnvError: this Python does not satisfy the file's ``python``, or the
            dependencies do not resolve (uv's words follow).
    """
    python = this_python()
    if spec.python and not python_satisfies(spec.python):
        raise EnvError(
            f"{spec.file or spec.name}: python: this controller's Python "
            f"{sys.version.split()[0]} does not satisfy {spec.python!r}, and the hosts "
            "run the controller's Python"
        )
    amesh = amesh_requirements() if include_amesh else []
    version = amesh_version() if include_amesh else ""
    platform = this_platform()
    with tempfile.TemporaryDirectory(prefix="amesh-lock-") as tmp:
        wanted = Path(tmp) / "requirements.in"
        wanted.write_text("".join(f"{r}\n" for r in (*spec.dependencies, *amesh)))
        command = [_uv(), "pip", "compile", str(wanted), "--generate-hashes", "--no-header"]
        command += ["--no-annotate", "--quiet", "--python-version", python]
        command += ["--cache-dir", str(cache_dir() / "uv")]
        for link in find_links:
            command += ["--find-links", str(link)]
        if no_index:
            command.append("--no-index")
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_RESOLVE_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired:
            raise EnvError(
                f"{spec.name}: resolving took more than {_RESOLVE_TIMEOUT:g} s"
            ) from None
    if done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip()
        raise EnvError(f"{spec.name}: the dependencies do not resolve:\n{said}")
    reqs = [_locked(entry, "uv pip compile") for entry in _entries(done.stdout)]
    return Lock(
        env=spec.name,
        python=python,
        platform=platform,
        amesh=version,
        inputs=lock_inputs(spec, python, platform, amesh),
        requirements=tuple(sorted(reqs, key=lambda r: r.name)),
    )


def env_hash(spec: EnvSpec, lock: Lock) -> str:
    """The environment's identity: sha256 (hex) of its canonical settings (not its
    targets, not its secrets' values, which it never holds) and its lock's text."""
    settings = json.dumps(canonical(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{settings}\n{lock.text()}".encode()).hexdigest()

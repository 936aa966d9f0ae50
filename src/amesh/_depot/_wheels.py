"""Wheels of what this interpreter has installed, and the requirement lines that pin
wheels by hash.

A launcher brings amesh's dependencies to a host that has only a Python interpreter:
the wheels they were installed from are usually gone (pip and uv keep them in caches
of their own, if at all), but an installed distribution lists its files (its
``RECORD``), and those are the wheel's contents. :func:`repack` writes them back into
a wheel, byte for byte the same every time (sorted entries, fixed timestamps), so its
digest, and the blobs a host already has, stay the same from one controller run to
the next.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ._store import file_digest

__all__ = ["repack", "requirement_lines"]

#: the timestamp of every entry (a zip file's earliest): the same bytes every time
_EPOCH = (1980, 1, 1, 0, 0, 0)
#: what an installer writes into a distribution's metadata that is no wheel's
_INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _tag(wheel_text: str) -> str:
    """The compressed tag set of a wheel's ``WHEEL`` file (``cp311-abi3-manylinux...``)."""
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_text.splitlines() if line.startswith("Tag:")
    ]
    if not tags:
        return "py3-none-any"
    parts: list[dict[str, None]] = [{}, {}, {}]
    for tag in tags:
        for i, part in enumerate(tag.split("-", 2)):
            parts[i][part] = None
    return "-".join(".".join(p) for p in parts)


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _script(arcname: str, path: Path) -> str:
    """The name under ``.data/scripts/`` of a file installed outside site-packages
    (``../../../bin/uv``), if it goes back into the wheel; "" if not.

    Only programs go back (uv's binary, which a host that builds venvs needs): a
    script starting with ``#!`` names this interpreter's path, and the console
    scripts among them are made again at install from ``entry_points.txt``."""
    parts = arcname.split("/")
    if len(parts) != 5 or parts[:4] != ["..", "..", "..", "bin"]:
        return ""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return ""
    return parts[4] if head != b"#!" else ""


def repack(name: str, out_dir: str | os.PathLike[str]) -> Path:
    """A wheel of installed distribution ``name``, written into ``out_dir``; its path.

    Raises:
        PackageNotFoundError: no distribution ``name`` is installed.
        ValueError: it is installed in editable mode (its files are a source tree's:
            build a wheel of that instead).
    """
    import importlib.metadata as md  # (here: it costs every `import amesh` 9 ms)

    dist = md.distribution(name)
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        raise ValueError(f"{name} is installed in editable mode: build its wheel instead")
    version = dist.version
    info = f"{_normal(dist.metadata['Name'])}-{version}.dist-info"
    wheel_text = dist.read_text("WHEEL") or ""
    members: list[tuple[str, Path]] = []
    scripts = f"{_normal(dist.metadata['Name'])}-{version}.data/scripts"
    for f in dist.files or ():
        arcname = str(f).replace(os.sep, "/")
        if arcname.startswith("../"):
            script = _script(arcname, Path(str(dist.locate_file(f))))
            if script:
                members.append((f"{scripts}/{script}", Path(str(dist.locate_file(f)))))
            continue
        if "__pycache__/" in arcname or arcname.endswith(".pyc"):
            continue  # compiled Python
        if arcname.startswith(info + "/") and arcname.rsplit("/", 1)[1] in _INSTALLER_FILES:
            continue
        members.append((arcname, Path(str(dist.locate_file(f)))))
    out = Path(out_dir) / f"{_normal(dist.metadata['Name'])}-{version}-{_tag(wheel_text)}.whl"
    record: list[str] = []
    tmp = out.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for arcname, path in sorted(members):
            data = path.read_bytes()
            zi = zipfile.ZipInfo(arcname, _EPOCH)
            zi.external_attr = (0o755 if os.access(path, os.X_OK) else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data, compresslevel=1)
            record.append(_record_line(arcname, data))
        record.append(f"{info}/RECORD,,")
        zi = zipfile.ZipInfo(f"{info}/RECORD", _EPOCH)
        zi.external_attr = 0o644 << 16
        z.writestr(zi, "\n".join(record) + "\n")
    os.replace(tmp, out)
    return out


def requirement_lines(wheels: Sequence[str | os.PathLike[str]]) -> str:
    """A requirements text that installs exactly ``wheels`` (their names and versions
    from their file names), each pinned by its hash (for ``--require-hashes``)."""
    lines = []
    for path in wheels:
        dist, version = Path(path).name.split("-")[:2]
        lines.append(f"{dist}=={version} --hash=sha256:{file_digest(path)}")
    return "\n".join(sorted(lines)) + "\n"

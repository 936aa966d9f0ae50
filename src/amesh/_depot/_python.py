"""Which Python an interpreter is, and whether it satisfies an environment's spec
(``">=3.11,<3.14"``: PEP 440 version specifiers, those that make sense of a Python
version)."""

from __future__ import annotations

import operator
import re
import subprocess
import sys
from collections.abc import Callable

__all__ = ["PythonError", "check_python", "python_version"]

#: seconds an interpreter has to say its version (a cold start on a busy host)
_VERSION_TIMEOUT = 30.0
_CLAUSE = re.compile(r"\s*(===|==|!=|~=|>=|<=|>|<)\s*([0-9]+(?:\.[0-9]+)*)(\.\*)?\s*")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}


class PythonError(RuntimeError):
    """A host's Python does not satisfy an environment's, or cannot be run."""


def python_version(python: str) -> tuple[int, int, int]:
    """The version of interpreter ``python`` (this one's without running it).

    Raises:
        PythonError: it cannot be run, or says no version.
    """
    if python in ("", sys.executable):
        return sys.version_info[:3]
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT,
            check=True,
        ).stdout
        major, minor, micro = (int(p) for p in out.strip().split("."))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise PythonError(f"cannot run Python {python}: {exc}") from None
    return major, minor, micro


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _pad(v: tuple[int, ...], n: int) -> tuple[int, ...]:
    return v + (0,) * (n - len(v))


def _holds(op: str, want: tuple[int, ...], star: bool, have: tuple[int, ...]) -> bool:
    if op in ("==", "!=", "==="):
        same = have[: len(want)] == want if star else _pad(have, 3) == _pad(want, 3)
        return same if op != "!=" else not same
    if op == "~=":  # compatible release: >= want, == want's prefix but its last part
        return have >= _pad(want, 3) and have[: len(want) - 1] == want[:-1]
    return _COMPARE[op](_pad(have, 3), _pad(want, 3))


def satisfies(version: tuple[int, ...], spec: str) -> bool:
    """Whether Python ``version`` satisfies ``spec`` (comma-separated clauses, all of
    which must hold; "": any).

    Raises:
        ValueError: ``spec`` is no version spec.
    """
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = _CLAUSE.fullmatch(clause)
        if m is None or (m[3] and m[1] not in ("==", "!=")):
            raise ValueError(f"not a Python version spec: {clause!r} (of {spec!r})")
        if not _holds(m[1], _release(m[2]), bool(m[3]), tuple(version)):
            return False
    return True


def check_python(python: str, spec: str, host: str) -> tuple[int, int, int]:
    """The version of ``python`` on ``host``, which satisfies ``spec``.

    Raises:
        PythonError: it does not (the message names the host, both versions and the
            interpreter), or cannot be run.
        ValueError: ``spec`` is no version spec.
    """
    version = python_version(python)
    if not satisfies(version, spec):
        shown = ".".join(map(str, version))
        raise PythonError(
            f"host {host}: Python {shown} ({python or sys.executable}) does not satisfy "
            f"the environment's python {spec!r}"
        )
    return version

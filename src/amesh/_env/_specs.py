"""PEP 508 requirements and PEP 440 specifier sets, checked with ``packaging`` where it
is installed (the ``env`` extra brings it), else by their outline only."""

from __future__ import annotations

import re
import sys

__all__ = ["check_requirement", "check_specifier", "python_satisfies", "requirement_name"]

#: a requirement's project name (PEP 508), before extras, version or marker
_PROJECT = re.compile(r"\s*([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)")
_CLAUSE = re.compile(r"\s*(~=|==|!=|<=|>=|<|>|===)\s*[A-Za-z0-9.*+!_-]+\s*")


def check_requirement(text: str) -> str:
    """What is wrong with the PEP 508 requirement ``text``; "" if nothing."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # pragma: no cover - packaging comes with the env extra
        return "" if _PROJECT.match(text) else f"not a PEP 508 requirement: {text!r}"
    try:
        Requirement(text)
    except InvalidRequirement as exc:
        return f"not a PEP 508 requirement ({text!r}): {_first_line(exc)}"
    return ""


def check_specifier(text: str) -> str:
    """What is wrong with the PEP 440 specifier set ``text`` (``">=3.11,<3.14"``); ""
    if nothing."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
    except ImportError:  # pragma: no cover - packaging comes with the env extra
        clauses = [c for c in text.split(",") if c.strip()]
        ok = all(_CLAUSE.fullmatch(c) for c in clauses)
        return "" if ok else f"not a PEP 440 version specifier: {text!r}"
    try:
        SpecifierSet(text)
    except InvalidSpecifier as exc:
        return f"not a PEP 440 version specifier ({text!r}): {_first_line(exc)}"
    return ""


def python_satisfies(specifier: str, version: str | None = None) -> bool:
    """Whether Python ``version`` (default: this one, ``X.Y.Z``) satisfies
    ``specifier`` ("" takes any)."""
    from packaging.specifiers import SpecifierSet

    if version is None:
        version = ".".join(map(str, sys.version_info[:3]))
    return SpecifierSet(specifier).contains(version, prereleases=True)


def requirement_name(text: str) -> str:
    """The normalised project name of requirement ``text`` (``Foo_Bar`` -> ``foo-bar``)."""
    found = _PROJECT.match(text)
    return re.sub(r"[-_.]+", "-", found.group(1)).lower() if found else text


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0]

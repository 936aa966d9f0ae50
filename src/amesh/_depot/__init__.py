"""What a host keeps for environments: a content-addressed blob store, a venv per
environment built from its wheels, and a tree per version of a workspace.

This is the package's front door. It sits low (it imports only amesh's settings and
the standard library; uv and pathspec, of the ``amesh[env]`` extra, when first used):
host agents (:mod:`amesh._hosts`) keep a store under their state directory and build
venvs and trees there for controllers, which scan workspaces and send what a host
lacks.
"""

from __future__ import annotations

from ._python import PythonError, check_python, python_version
from ._store import BlobStore, BlobWriter, DigestError, file_digest
from ._venv import MARKER, VenvError, realise_venv
from ._wheels import repack, requirement_lines
from ._workspace import Entry, HashCache, Manifest, Scanned, materialise, scan

__all__ = [
    "MARKER",
    "BlobStore",
    "BlobWriter",
    "DigestError",
    "Entry",
    "HashCache",
    "Manifest",
    "PythonError",
    "Scanned",
    "VenvError",
    "check_python",
    "file_digest",
    "materialise",
    "python_version",
    "realise_venv",
    "repack",
    "requirement_lines",
    "scan",
]

"""The ``amesh`` command itself: what it says when run bare, asked its version, or run
with a misspelt ``AMESH_*`` variable; ``amesh keygen``'s answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import amesh


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m amesh ARGS`` (a deadline of its own), with ``env`` added to ours."""
    return subprocess.run(
        [sys.executable, "-m", "amesh", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_a_misspelt_variable_is_warned_of_with_the_closest_name(tmp_path: Path) -> None:
    """Issue 36, item 16: AMESH_STATE_DIRR=... was ignored silently."""
    out = cli("keygen", str(tmp_path / "k"), env={"AMESH_STATE_DIRR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stderr == (
        "amesh: warning: AMESH_STATE_DIRR is not an amesh setting, and is ignored; did you "
        "mean AMESH_STATE_DIR? (the settings: docs/guides/configuration.md)\n"
    )


def test_version_and_bare_amesh_print_help() -> None:
    """Issue 36, item 19: `amesh --version` failed, and bare `amesh` was an error."""
    version = cli("--version")
    assert (version.returncode, version.stdout) == (0, f"amesh {amesh.__version__}\n")
    bare = cli()
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.startswith("usage: amesh") and "keygen" in bare.stdout
    assert bare.stdout == cli("--help").stdout


def test_keygen_says_what_it_did_and_why_it_did_not(tmp_path: Path) -> None:
    """Issue 36, item 19: an existing file gave `[Errno 17] File exists: ...`."""
    path = tmp_path / "job.key"
    made = cli("keygen", str(path))
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"wrote a new key to {path} (readable by you only)\n"
    key = path.read_bytes()
    again = cli("keygen", str(path))
    assert again.returncode == 1 and "Errno" not in again.stderr
    assert again.stderr == (
        f"amesh keygen: {path} exists, and a key file is never overwritten (remove it "
        "first, or choose another path)\n"
    )
    assert path.read_bytes() == key
    nowhere = cli("keygen", str(tmp_path / "no" / "job.key"))
    assert nowhere.returncode == 1
    assert nowhere.stderr == (
        f"amesh keygen: cannot write {tmp_path / 'no' / 'job.key'}: No such file or directory\n"
    )

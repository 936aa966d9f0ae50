"""The ``amesh`` command itself: what it says when run bare, asked its version, or run
with a misspelt ``AMESH_*`` variable; ``amesh keygen``'s answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def amesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
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
    out = amesh("keygen", str(tmp_path / "k"), env={"AMESH_STATE_DIRR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stderr == (
        "amesh: warning: AMESH_STATE_DIRR is not an amesh setting, and is ignored; did you "
        "mean AMESH_STATE_DIR? (the settings: docs/guides/configuration.md)\n"
    )

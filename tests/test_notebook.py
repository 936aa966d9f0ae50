"""``examples/notebook.ipynb`` runs on a real Jupyter kernel (ipykernel, driven by
nbclient), and each cell shows what it should: results, worker output in the cell,
a replaced actor mesh on the same processes, a killed rank's error.

nbclient runs in a process of its own: its ZeroMQ context keeps sockets open for the
life of the process that made it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

_EXECUTE = """
import sys
import nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(
    nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": sys.argv[3]}}
).execute()
nbformat.write(nb, sys.argv[2])
"""


def _text(cell: Any) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append(o["data"].get("text/plain", ""))
        elif o["output_type"] == "error":
            out.append(f"{o['ename']}: {o['evalue']}")
    return "".join(out)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_example_notebook_runs_in_a_kernel(tmp_path: Path) -> None:
    executed = tmp_path / "executed.ipynb"
    with anyio.fail_after(180):
        run = await anyio.run_process(
            [
                sys.executable,
                "-c",
                _EXECUTE,
                str(EXAMPLES / "notebook.ipynb"),
                str(executed),
                str(tmp_path),
            ],
            check=False,
        )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    nb = nbformat.read(executed, as_version=4)
    code = [_text(c) for c in nb.cells if c.cell_type == "code"]
    assert code[1] == "[2, 2, 2, 2]"
    # every rank printed it; the controller folded the four lines into one
    assert code[2] == "[counters 0-3] hello from a worker\n"
    assert code[3] == "same processes: True\n[110, 110, 110, 110]"
    assert code[4].startswith("SupervisionError: counters.incr at rank 1")
    assert "SIGKILL" in code[4]
    assert code[5] == "stopped\n"

"""``examples/notebook.ipynb`` runs on a real Jupyter kernel (ipykernel, driven by
nbclient), and each cell shows what it should: results, worker output in the cell,
a replaced actor mesh on the same processes, a killed rank's error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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


@pytest.mark.timeout(180)
def test_the_example_notebook_runs_in_a_kernel(tmp_path: Path) -> None:
    nb = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = NotebookClient(
        nb,
        timeout=60,  # per cell
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    code = [_text(c) for c in nb.cells if c.cell_type == "code"]
    assert code[1] == "[2, 2, 2, 2]"
    # every rank printed it; the controller folded the four lines into one
    assert code[2] == "[counters 0-3] hello from a worker\n"
    assert code[3] == "same processes: True\n[110, 110, 110, 110]"
    assert code[4].startswith("SupervisionError: counters.incr at rank 1")
    assert "SIGKILL" in code[4]
    assert code[5] == "stopped\n"

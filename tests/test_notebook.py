"""``examples/notebook.ipynb`` runs on a real Jupyter kernel (ipykernel, driven by
nbclient), and each cell shows what it should: results, worker output in the cell,
a replaced actor mesh on the same processes, a killed rank's error.

nbclient runs in a process of its own: its ZeroMQ context keeps sockets open for the
life of the process that made it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import anyio
import nbformat
import pytest

import amesh

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
AMESH_DIR = str(Path(amesh.__file__).parent)

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
    # the failure's notice, printed at once in the cell that runs, then the error
    assert "amesh: unhandled supervision failure" in code[4]
    last = code[4].rstrip("\n").splitlines()[-1]
    assert last.startswith("SupervisionError: counters.incr at rank 1")
    assert "SIGKILL" in last
    assert code[5] == "stopped\n"


# Cells sent one by one to a kernel (jupyter_client), and every stream or error output
# on its IOPub channel recorded with the msg_id of the request it names as its parent:
# that is the cell Jupyter shows it in. A cell's wait ends when the kernel is idle after
# it and, with `until`, once a recorded text contains `until`.
_CELLS = """
import json, sys
from jupyter_client.manager import start_new_kernel

cells = json.loads(sys.argv[1])
km, kc = start_new_kernel(kernel_name="python3", cwd=sys.argv[2])
outputs, ids = [], []
try:
    for code, until in cells:
        msg_id = kc.execute(code)
        ids.append(msg_id)
        idle = False
        while not idle or (until and not any(until in text for _, text in outputs)):
            msg = kc.get_iopub_msg(timeout=60)
            parent, content = msg["parent_header"].get("msg_id"), msg["content"]
            if msg["msg_type"] == "stream":
                outputs.append((parent, content["text"]))
            elif msg["msg_type"] == "error":
                lines = [content["ename"] + ": " + content["evalue"], *content["traceback"]]
                outputs.append((parent, chr(10).join(lines)))
            elif msg["msg_type"] == "status" and parent == msg_id:
                idle = idle or content["execution_state"] == "idle"
finally:
    kc.stop_channels()
    km.shutdown_kernel()
print(json.dumps({"ids": ids, "outputs": outputs}))
"""

_LATE = '''
import os, signal, threading
import amesh
from amesh import Actor, endpoint

class Late(Actor):
    def __init__(self):
        self.go = threading.Event()

    @endpoint
    def arm(self) -> None:
        """A thread of the actor's prints once fire() is called: after arm returned."""
        def later() -> None:
            self.go.wait(60)
            print("late line", flush=True)
        threading.Thread(target=later, daemon=True).start()

    @endpoint
    def fire(self) -> None:
        self.go.set()

procs = amesh.ProcMesh({"procs": 2}).get()
late = procs.spawn("late", Late).get()
'''


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_late_output_goes_to_the_cell_that_runs_when_it_arrives(tmp_path: Path) -> None:
    """Worker lines and a supervision notice that arrive after the call that caused
    them returned show in the cell running (or last run) then, not in the cell that
    started the session (ipykernel 7 keeps a parent per context: the session's tasks
    must not keep the one of the cell they were started from)."""
    cells = [
        (_LATE, None),
        ("late.arm.broadcast().get()", None),
        ("late.fire.broadcast().get()", "late line"),
        ("os.kill(procs.pids[1], signal.SIGKILL)", "unhandled supervision failure"),
        ("procs.stop().get()", None),
    ]
    with anyio.fail_after(180):
        run = await anyio.run_process(
            [sys.executable, "-c", _CELLS, json.dumps(cells), str(tmp_path)], check=False
        )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    got = json.loads(run.stdout)
    ids, outputs = got["ids"], got["outputs"]
    late_lines = [parent for parent, text in outputs if "late line" in text]
    notices = [parent for parent, text in outputs if "supervision failure" in text]
    assert late_lines and set(late_lines) == {ids[2]}, outputs
    assert notices and set(notices) == {ids[3]}, outputs


_FAILING = """
import amesh
from amesh import Actor, endpoint

def check(x):
    if x < 0:
        raise ValueError(f"negative: {x}")

class Checker(Actor):
    @endpoint
    def check(self, x: int) -> None:
        check(x)

procs = amesh.ProcMesh({"procs": 1}).get()
checker = procs.spawn("checker", Checker).get()
"""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_remote_error_in_a_cell_shows_cells_and_no_amesh_frames(tmp_path: Path) -> None:
    """The remote frames of code defined in a cell read ``Cell In[1], line N`` (not the
    kernel's temporary file), and the local part has the cell's frame, not amesh's."""
    cells = [
        (_FAILING, None),
        ("checker.check.call_one(-1).get()", None),
        ("await checker.check.call_one(-2)", None),
        ("procs.stop().get()", None),
    ]
    with anyio.fail_after(180):
        run = await anyio.run_process(
            [sys.executable, "-c", _CELLS, json.dumps(cells), str(tmp_path)], check=False
        )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    got = json.loads(run.stdout)
    errors = dict(got["outputs"])
    for cell, x in ((1, -1), (2, -2)):
        text = re.sub(r"\x1b\[[0-9;]*m", "", errors[got["ids"][cell]])
        assert text.startswith(f"ActorError: ValueError: negative: {x} in actor 'checker'")
        # the remote frames, of code from cell 1
        assert re.search(r"Cell In\[1\], line \d+, in check\n +check\(x\)\n", text), text
        assert re.search(r"Cell In\[1\], line \d+, in check\n +raise ValueError", text)
        assert f"Cell In[{cell + 1}], line 1" in text  # the call, here
        assert "ipykernel_" not in text
        assert AMESH_DIR not in text and "_session.py" not in text, text

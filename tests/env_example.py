"""examples/environments.ipynb run by nbclient, the same cells on any target of the
example's environment (tests/test_environment.py: ``laptop``; tests/test_env_slurm.py:
``cluster``, on the SLURM nodes): the example's file with a workspace of the test's
(the notebook edits it, and puts it back), locked and fetched offline beforehand, so
that the notebook finds both."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import nbformat

import amesh
from amesh._env import Environment, fetch_wheels

from .test_notebook import _EXECUTE as NOTEBOOK
from .test_notebook import EXAMPLES
from .test_notebook import _text as notebook_text

__all__ = ["example_env", "expected_cells", "run_example"]


def example_env(folder: Path, links: Path, cluster: str = "") -> Path:
    """The example's environment file in ``folder/envs``, its workspace a copy of the
    example's in ``folder/nbws``, and with ``cluster`` (a ``[targets.cluster]`` table)
    in place of the example's cluster target when given; locked, and its wheels
    fetched, from ``links`` only."""
    workspace = folder / "nbws"
    workspace.mkdir()
    example = EXAMPLES / "envs" / "demo_ws" / "greeting.py"
    (workspace / "greeting.py").write_text(example.read_text())
    (folder / "envs").mkdir(exist_ok=True)
    path = folder / "envs" / "demo.toml"
    text = (EXAMPLES / "envs" / "demo.toml").read_text()
    text = text.replace('paths = ["demo_ws"]', 'paths = ["../nbws"]')
    if cluster:
        text = text[: text.index("[targets.cluster]")] + cluster
    path.write_text(text)
    env = Environment.load(path, find_links=[links], no_index=True)
    fetch_wheels(env._env.lock, find_links=[links], no_index=True)
    return path


def expected_cells(hosts: list[str]) -> list[str]:
    """What the example's code cells print with one rank on each of ``hosts``."""
    before = [(host, True, 1) for host in hosts]
    after = [(host, True, 2) for host in hosts]
    return [
        "demo ['cluster', 'laptop']\n",
        repr(before),
        f"reloaded: {[['greeting']] * len(hosts)!r}\n{after!r}",
        "stopped\n",
    ]


async def run_example(env_file: Path, target: str, tmp_path: Path, **env: str) -> list[str]:
    """The example notebook run in a kernel on ``env_file``'s ``target`` (with ``env``
    besides this process's environment): what each code cell printed. The
    workspace's module is as it was after."""
    executed = tmp_path / "executed.ipynb"
    module = env_file.parent.parent / "nbws" / "greeting.py"
    # (the kernel runs in tmp_path: this amesh's source, whatever PYTHONPATH says there)
    source = str(Path(amesh.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    with anyio.fail_after(110):
        run = await anyio.run_process(
            [
                *(sys.executable, "-c", NOTEBOOK, str(EXAMPLES / "environments.ipynb")),
                *(str(executed), str(tmp_path)),
            ],
            check=False,
            env={
                **os.environ,
                **env,
                "EXAMPLE_ENV_FILE": str(env_file),
                "EXAMPLE_TARGET": target,
                "PYTHONPATH": path,
            },
        )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    assert "VALUE = 1\n" in module.read_text()
    nb = nbformat.read(executed, as_version=4)
    return [notebook_text(c) for c in nb.cells if c.cell_type == "code"]

"""Shared fixtures: both anyio backends, and a check that no test leaks anything."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from amesh import _config

pytest_plugins = ["amesh.testing.pytest_plugin"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(autouse=True, scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A state directory of the session's own (the registry of live meshes that every
    controller writes, the local agent's files): nothing lands in the real home."""
    old = os.environ.get("AMESH_STATE_DIR")
    os.environ["AMESH_STATE_DIR"] = str(tmp_path_factory.mktemp("amesh-state"))
    yield
    if old is None:
        del os.environ["AMESH_STATE_DIR"]
    else:
        os.environ["AMESH_STATE_DIR"] = old


class _MonkeyPatch(pytest.MonkeyPatch):
    """``monkeypatch`` whose changes to ``AMESH_*`` variables reach amesh's settings,
    which it reads once per process (even after the test's first use of amesh)."""

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        if name.startswith("AMESH_"):
            _config.reset(overrides=False)

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        if name.startswith("AMESH_"):
            _config.reset(overrides=False)


@pytest.fixture
def monkeypatch() -> Iterator[pytest.MonkeyPatch]:
    patch = _MonkeyPatch()
    yield patch
    patch.undo()
    _config.reset(overrides=False)


@pytest.fixture(autouse=True)
def no_leaks(amesh_no_leaks: None) -> None:
    """Every test fails if it leaves a child process or a socket file behind."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slurm` need root (tests/cluster.py): elsewhere, or with
    AMESH_CLUSTER_TESTS=0, deselect them and list them at the end of the session."""
    from .cluster import deselect_cluster_tests

    deselect_cluster_tests(config, items)

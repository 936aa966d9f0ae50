"""The public API is exactly what amesh/__init__.py re-exports, and importing is light."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import amesh


def test_every_public_name_is_exported() -> None:
    public = {n for n in vars(amesh) if not n.startswith("_")} - {"annotations"}
    assert set(amesh.__all__) <= public
    # submodules that Python binds as attributes on import are not API
    leaked = {
        n for n in public - set(amesh.__all__) if not isinstance(getattr(amesh, n), type(sys))
    }
    assert leaked == set(), f"public names missing from __all__: {leaked}"
    for name in amesh.__all__:
        obj = getattr(amesh, name)
        assert getattr(obj, "__doc__", None), f"amesh.{name} has no docstring"


def test_environments_are_public() -> None:
    assert {"Environment", "EnvError"} <= set(amesh.__all__)
    assert issubclass(amesh.EnvError, ValueError)  # (a bad file, a bad lock: bad input)
    assert callable(amesh.Environment.load) and callable(amesh.Environment.spawn_procs)


def test_amesh_testing_exports_what_users_test_with() -> None:
    import amesh.testing

    expected = {
        "FaultyTransport",
        "InProcessHost",
        "LeakError",
        "MemoryTransport",
        "no_leaks",
        "open_runtime",
    }
    assert set(amesh.testing.__all__) == expected
    public = {n for n in vars(amesh.testing) if not n.startswith("_")} - {"annotations"}
    modules = {n for n in public if isinstance(getattr(amesh.testing, n), type(sys))}
    assert public - modules == expected
    for name in expected:
        assert getattr(amesh.testing, name).__doc__, f"amesh.testing.{name} has no docstring"


def test_import_does_not_pull_in_torch_or_trio() -> None:
    code = "import sys, amesh; print(sorted({'torch', 'trio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# The zygote's rehearsal (a one-process mesh on the in-process host) is the product
# code that once imported amesh.testing; it runs here as it does before a fork batch.
_NO_TESTING = textwrap.dedent(
    """
    import sys

    import amesh
    from amesh._hosts import _zygote_main

    def testing() -> list[str]:
        return sorted(m for m in sys.modules if m.split(".")[:2] == ["amesh", "testing"])

    assert testing() == [], f"import amesh imported {testing()}"
    _zygote_main._rehearse()
    assert _zygote_main._rehearsed, "the rehearsal failed (see its debug log)"
    assert testing() == [], f"the zygote's rehearsal imported {testing()}"
    """
)


def test_product_code_imports_no_testing_module() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AMESH_TRANSPORT_IMPL"}
    out = subprocess.run(
        [sys.executable, "-c", _NO_TESTING], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr


# Frames over the default transport, then a ProcMesh on it: pynng is in neither the
# controller nor a worker (forked by the zygote, which preloads only what is chosen).
_NO_PYNNG = textwrap.dedent(
    """
    import sys

    import anyio

    import amesh
    from amesh._transport import StreamTransport, heartbeat_sender, open_transport


    class Modules(amesh.Actor):
        @amesh.endpoint
        def loaded(self, name: str) -> bool:
            return name in sys.modules


    async def frames() -> None:
        t = open_transport()
        assert isinstance(t, StreamTransport), t
        got: list[bytes] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.serve, lambda f, peer: (got.append(bytes(f)), tg.cancel_scope.cancel()))
            await t.send(t.address, b"ping")
        beat = heartbeat_sender(t.address)
        beat.close()
        t.close()
        assert got == [b"ping"], got


    async def mesh() -> bool:
        async with amesh.ProcMesh(per_host={"procs": 1}) as procs:
            probe = await procs.spawn("probe", Modules)
            return await probe.loaded.call_one("pynng")


    anyio.run(frames)
    assert "pynng" not in sys.modules, "the stream transport imported pynng"
    assert amesh.run(mesh) is False, "a worker imported pynng"
    assert "pynng" not in sys.modules, "a ProcMesh on the stream transport imported pynng"
    """
)


def test_default_transport_does_not_pull_in_pynng() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("AMESH_TRANSPORT_IMPL", "AMESH_ZYGOTE")}
    out = subprocess.run(
        [sys.executable, "-c", _NO_PYNNG], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr


# Importing (again) every module of the hosts layer registers nothing: only the package's
# __init__ plugs the hosts in, by one call.
_NO_SIDE_EFFECTS = textwrap.dedent(
    """
    import importlib
    import pkgutil

    import amesh
    from amesh import _hosts
    from amesh._debug import _client
    from amesh._mesh import _host

    _host._default_host = None
    _host._persistent_host = None
    _client._remote_debuggers = list
    for info in pkgutil.iter_modules(_hosts.__path__, "amesh._hosts."):
        importlib.reload(importlib.import_module(info.name))
    importlib.reload(_hosts)
    assert _host._default_host is None, _host._default_host
    assert _host._persistent_host is None, _host._persistent_host
    assert _client._remote_debuggers is list, _client._remote_debuggers
    _hosts.plug_in()
    assert _host.default_host() is _hosts.this_host()
    assert _host._persistent_host is _hosts.local_holder
    """
)


def test_importing_the_hosts_registers_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_SIDE_EFFECTS], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr

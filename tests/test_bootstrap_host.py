"""The pieces a launcher brings to a host with nothing but Python, on this machine
(the real hosts are in tests/test_env_slurm.py and tests/test_env_ssh.py, root only):
the bootstrap's venv, built once per bundle from wheels that arrive on a stream and
rebuilt when a builder left it unfinished; the launch server, which answers only
requests signed with the job key; and repack, which keeps uv's binary."""

from __future__ import annotations

import io
import subprocess
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from amesh._depot import file_digest, repack
from amesh._hosts import AgentBundle
from amesh._hosts._bootstrap_host import (
    AUTH_HEADER,
    MARKER,
    bundle_digest,
    read_frames,
    realise,
    sign,
)
from amesh._hosts._bundle import LaunchServer

from .depot_wheels import tiny_wheel

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(32))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """uv's wheel (repacked from this interpreter's) and a tiny one."""
    out = tmp_path_factory.mktemp("wheels")
    tiny = tiny_wheel(out, "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 7\n"})
    return [repack("uv", out), tiny]


def manifest_of(wheels: list[Path]) -> list[tuple[str, str]]:
    return sorted((w.name, file_digest(w)) for w in wheels)


def frames(wheels: list[Path]) -> io.BytesIO:
    """The wheels as a launcher sends them over an ssh session."""
    by_name = {w.name: w for w in wheels}
    out = io.BytesIO()
    for name, _ in manifest_of(wheels):
        data = by_name[name].read_bytes()
        out.write(f"{len(data)}\n".encode() + data)
    out.seek(0)
    return out


def test_repack_keeps_uvs_binary(wheels: list[Path]) -> None:
    with zipfile.ZipFile(wheels[0]) as z:
        scripts = [n for n in z.namelist() if ".data/scripts/" in n]
        assert [n.rsplit("/", 1)[1] for n in scripts] == ["uv", "uvx"]
        assert z.getinfo(scripts[0]).external_attr >> 16 == 0o755


def test_the_agent_venv_is_built_once_and_a_half_built_one_again(
    tmp_path: Path, wheels: list[Path]
) -> None:
    manifest = manifest_of(wheels)
    home = tmp_path / "agents"
    calls: list[Path] = []

    def receive(into: Path) -> None:
        calls.append(into)
        read_frames(frames(wheels), manifest, into)

    python = realise(home, manifest, receive)
    venv = home / bundle_digest(manifest)
    assert python == venv / "bin" / "python"
    said = subprocess.run(
        [python, "-c", "import tinypkg; print(tinypkg.VALUE)"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert said.stdout.strip() == "7"
    assert not list(home.glob(".wheels-*"))  # the received wheels are gone
    built = (venv / MARKER).stat().st_mtime_ns

    assert realise(home, manifest, receive) == python  # used as it is
    assert len(calls) == 1 and (venv / MARKER).stat().st_mtime_ns == built

    (venv / MARKER).unlink()  # as a builder killed before its marker leaves it
    (venv / "junk").write_text("")
    assert realise(home, manifest, receive) == python
    assert len(calls) == 2 and (venv / MARKER).exists() and not (venv / "junk").exists()


def test_a_damaged_wheel_builds_nothing(tmp_path: Path, wheels: list[Path]) -> None:
    manifest = manifest_of(wheels)
    stream = frames(wheels)
    damaged = io.BytesIO(stream.getvalue()[:-1] + b"x")
    with pytest.raises(ValueError, match="sha256"):
        realise(tmp_path, manifest, lambda into: read_frames(damaged, manifest, into))
    assert [p.name for p in tmp_path.iterdir()] == [f"{bundle_digest(manifest)}.lock"]


def test_the_launch_server_answers_signed_requests_only(tmp_path: Path) -> None:
    wheel = tiny_wheel(tmp_path, "tinypkg", "1.0", {"tinypkg/__init__.py": ""})
    sha = file_digest(wheel)
    bundle = AgentBundle(((wheel.name, sha, str(wheel)),))
    agents: list[tuple[str, str]] = []
    server = LaunchServer("127.0.0.1", KEY, bundle, lambda n, a: agents.append((n, a)))

    def request(path: str, key: bytes, body: bytes | None = None) -> bytes:
        method = "GET" if body is None else "POST"
        auth = sign(key, method, path, body or b"")
        req = urllib.request.Request(server.url + path, data=body, headers={AUTH_HEADER: auth})
        with urllib.request.urlopen(req, timeout=10) as reply:
            return bytes(reply.read())

    with server.serving():
        assert request(f"/wheel/{sha}", KEY) == wheel.read_bytes()
        with pytest.raises(urllib.error.HTTPError, match="403"):
            request(f"/wheel/{sha}", bytes(32))
        with pytest.raises(urllib.error.HTTPError, match="404"):
            request(f"/wheel/{'0' * 64}", KEY)
        with pytest.raises(urllib.error.HTTPError, match="403"):
            request("/agent/n1", bytes(32), b"tcp://10.0.0.1:5")
        request("/agent/n1", KEY, b"tcp://10.0.0.1:5")
    assert agents == [("n1", "tcp://10.0.0.1:5")]

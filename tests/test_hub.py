"""Sharing environments through a hub (issue 38, item 5): a directory hub and an HTTP
one (``amesh hub serve``, a real server on 127.0.0.1), their versions immutable and
named by hash, their pulls byte-identical, their tokens enforced, and no secret's value
anywhere in them or in the server's log.

The locks are written with :class:`amesh._env.Lock` directly (no resolve, no network):
a hub stores a lock's bytes and never reads an index.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from amesh import _cli
from amesh._env import DirHub, EnvError, Lock, Locked, Meta, env_hash, load_spec, lock_path
from amesh._env._hub import version_hash
from amesh._env._lock import lock_inputs, this_platform, this_python

pytestmark = pytest.mark.timeout(60)

SECRET = "HUB_TEST_SECRET"
#: the value the pushing process holds: it must turn up nowhere
SECRET_VALUE = "s3cr3t-value-that-must-never-leave-7f1c2a"
READ_TOKEN = "read-token-0123456789abcdef"
WRITE_TOKEN = "write-token-0123456789abcdef"
#: seconds the server has to say where it listens
_START_TIMEOUT = 30.0


def write_env(project: Path, deps: tuple[str, ...] = (), extra: str = "") -> Path:
    """``project/envs/exp.toml`` and a current lock for it, written without a resolve."""
    path = project / "envs" / "exp.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    listed = ", ".join(json.dumps(d) for d in deps)
    path.write_text(
        f'format = 1\nname = "exp"\npython = ">=3.11"\ndependencies = [{listed}]\n'
        f'secrets = ["{SECRET}"]\n{extra}'
    )
    spec = load_spec(path)
    reqs = tuple(Locked(d, "1.0", (hashlib.sha256(d.encode()).hexdigest(),)) for d in deps)
    lock = Lock(
        env="exp",
        python=this_python(),
        platform=this_platform(),
        amesh="",
        inputs=lock_inputs(spec, this_python(), this_platform(), []),
        requirements=reqs,
    )
    lock_path(path).write_text(lock.text())
    return path


def version_of(path: Path) -> str:
    return version_hash(path.read_bytes(), lock_path(path).read_bytes())


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(*args: str) -> int:
    return _cli.main(["env", *args])


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory (the working directory) whose process holds the secret."""
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    monkeypatch.delenv("AMESH_HUB", raising=False)
    monkeypatch.delenv("AMESH_HUB_TOKEN_FILE", raising=False)
    root = tmp_path / "project"
    root.mkdir()
    monkeypatch.chdir(root)
    return root


def test_a_directory_hub_round_trip(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = tmp_path / "hub"
    first = write_env(project, ("tinya",))
    v1 = version_of(first)
    assert cli("push", "exp", "--hub", str(hub)) == 0
    version = hub / "exp" / v1
    assert sorted(p.name for p in version.iterdir()) == ["env.toml", "exp.lock", "meta.json"]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in version.iterdir()}

    # the same content again: nothing written
    assert cli("push", "exp", "--hub", str(hub)) == 0
    assert "nothing pushed" in capsys.readouterr().out
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in version.iterdir()} == before

    # a changed environment: a new version, which becomes the latest, the first its parent
    second = write_env(project, ("tinya", "tinyb"))
    v2 = version_of(second)
    assert cli("push", "exp", "--hub", str(hub)) == 0
    assert (hub / "exp" / "latest").read_text().strip() == v2
    metas = DirHub(hub).versions("exp")
    assert [m.hash for m in metas] == [v1, v2]
    assert metas[1].parent == v1 and metas[0].parent is None
    assert metas[1].pushed_by and metas[1].python and metas[1].amesh

    assert cli("list", "--hub", str(hub)) == 0
    listed = capsys.readouterr().out
    assert f"{v2[:12]}" in listed and f"{v1[:12]}" in listed and "latest" in listed

    # the latest, and an older version by a prefix of its hash, each byte-identical
    elsewhere = tmp_path / "elsewhere"
    assert cli("pull", "exp", "--hub", str(hub), "--to", str(elsewhere)) == 0
    pulled = elsewhere / "envs" / "exp.toml"
    assert digest(pulled) == digest(second)
    assert digest(lock_path(pulled)) == digest(lock_path(second))
    assert version_of(pulled) == v2
    older = tmp_path / "older"
    assert cli("pull", f"exp@{v1[:10]}", "--hub", str(hub), "--to", str(older)) == 0
    assert version_of(older / "envs" / "exp.toml") == v1


def test_a_version_is_never_rewritten(project: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    path = write_env(project)
    assert cli("push", "exp", "--hub", str(hub)) == 0
    stored = hub / "exp" / version_of(path) / "env.toml"
    kept = stored.read_bytes()
    first = version_of(path)
    # a target changes the file, not the environment: a new version, the first kept
    with path.open("a") as out:
        out.write('[targets.here]\nlauncher = "local"\n')
    assert cli("push", "exp", "--hub", str(hub)) == 0
    assert stored.read_bytes() == kept
    versions = DirHub(hub).versions("exp")
    assert {m.hash for m in versions} == {first, version_of(path)}
    assert len({m.environment for m in versions}) == 1  # (the same venv on a host)
    assert DirHub(hub).latest("exp") == version_of(path)
    meta = next(m for m in versions if m.hash == first)
    assert DirHub(hub).put(b"other", b"other", meta) is False
    assert stored.read_bytes() == kept


def test_concurrent_pushes_of_one_version_keep_one(project: Path, tmp_path: Path) -> None:
    path = write_env(project)
    meta = Meta(
        name="exp",
        hash=version_of(path),
        environment=env_hash(load_spec(path), Lock.parse(lock_path(path).read_text())),
        pushed_by="t@h",
        time="2026-01-01T00:00:00+00:00",
        amesh="0",
        python="3",
        platform="p",
    )
    hub, results, start = DirHub(tmp_path / "hub"), [], threading.Barrier(4)
    env, lock = path.read_bytes(), lock_path(path).read_bytes()

    def push() -> None:
        start.wait()
        results.append(hub.put(env, lock, meta))

    threads = [threading.Thread(target=push) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, False, True]
    assert sorted(p.name for p in (tmp_path / "hub" / "exp").iterdir()) == [meta.hash, "latest"]


def test_push_needs_a_current_lock_and_locks_nothing(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = tmp_path / "hub"
    path = write_env(project)
    lock_path(path).unlink()
    assert cli("push", "exp", "--hub", str(hub)) == 1
    assert "amesh env lock" in capsys.readouterr().err
    write_env(project)
    path.write_text(path.read_text().replace("dependencies = []", 'dependencies = ["new"]'))
    assert cli("push", "exp", "--hub", str(hub)) == 1
    assert "changed" in capsys.readouterr().err
    assert not hub.exists()


def test_pull_refuses_a_tampered_version_and_a_different_local_copy(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = tmp_path / "hub"
    path = write_env(project)
    assert cli("push", "exp", "--hub", str(hub)) == 0
    # here, the project's own copy differs from the hub's: kept unless --force
    original = path.read_bytes()
    path.write_bytes(original + b"# mine\n")
    assert cli("pull", "exp", "--hub", str(hub)) == 1
    assert "--force" in capsys.readouterr().err
    assert cli("pull", "exp", "--hub", str(hub), "--force") == 0
    assert path.read_bytes() == original

    stored = hub / "exp" / version_of(path) / "env.toml"
    stored.chmod(0o644)
    stored.write_text(stored.read_text().replace('">=3.11"', '">=3.12"'))
    assert cli("pull", "exp", "--hub", str(hub), "--to", str(tmp_path / "x")) == 1
    assert "do not hash" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("ref", ["../exp", "..", "a/b", "Exp", "exp@../../x", "exp@zz1234"])
def test_names_and_versions_that_are_paths_are_refused(
    project: Path, tmp_path: Path, ref: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("pull", ref, "--hub", str(tmp_path / "hub"), "--to", str(tmp_path / "x")) == 1
    assert capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    name, _, version = ref.partition("@")
    with pytest.raises(EnvError):
        DirHub(tmp_path).get(name, version or "0" * 64)


def test_the_hub_setting_is_the_default(
    project: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_env(project)
    assert cli("push", "exp") == 1
    assert "AMESH_HUB" in capsys.readouterr().err
    assert cli("push", "exp", "--hub", "ftp://example.invalid/hub") == 1
    assert "http://" in capsys.readouterr().err
    monkeypatch.setenv("AMESH_HUB", str(tmp_path / "hub"))
    assert cli("push", "exp") == 0
    assert DirHub(tmp_path / "hub").names() == ["exp"]


@dataclass
class Server:
    url: str
    root: Path
    log: Path
    read: Path
    write: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``amesh hub serve`` on 127.0.0.1, any free port; its log (stderr) in a file."""
    tmp = tmp_path_factory.mktemp("served")
    read, write = tmp / "read.token", tmp / "write.token"
    read.write_text(READ_TOKEN + "\n")
    write.write_text(WRITE_TOKEN + "\n")
    log = tmp / "server.log"
    command = [sys.executable, "-m", "amesh", "hub", "serve", str(tmp / "hub")]
    command += ["--listen", "127.0.0.1:0", "--read-token-file", str(read)]
    command += ["--write-token-file", str(write)]
    with log.open("wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=_START_TIMEOUT)
        line = proc.stdout.readline().decode() if ready else ""
        assert " at http://127.0.0.1:" in line, f"the server did not start: {log.read_text()}"
        yield Server(line.split(" at ")[1].strip(), tmp / "hub", log, read, write)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == 0, log.read_text()


def test_an_http_hub_round_trip(
    server: Server, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_env(project, ("tinyhttp",))
    pushing = ("--hub", server.url, "--token-file", str(server.write))
    reading = ("--hub", server.url, "--token-file", str(server.read))
    assert cli("push", "exp", *pushing) == 0
    assert cli("push", "exp", *pushing) == 0
    assert "nothing pushed" in capsys.readouterr().out
    assert (server.root / "exp" / version_of(path) / "exp.lock").is_file()
    assert cli("list", *reading) == 0
    assert version_of(path)[:12] in capsys.readouterr().out
    assert cli("pull", "exp", *reading, "--to", str(tmp_path / "there")) == 0
    pulled = tmp_path / "there" / "envs" / "exp.toml"
    assert digest(pulled) == digest(path)
    assert digest(lock_path(pulled)) == digest(lock_path(path))


def _status(url: str, method: str = "GET", token: str | None = None, body: bytes = b"") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(
        url, data=body if method == "PUT" else None, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_the_http_hub_refuses_whoever_lacks_the_token(
    server: Server, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_env(project, ("tinyguarded",))
    version = version_of(path)
    listing = f"{server.url}/v1/envs"
    assert _status(listing) == 401
    assert _status(listing, token="") == 401
    assert _status(listing, token=READ_TOKEN + "x") == 401
    assert _status(listing, token=READ_TOKEN) == 200
    assert _status(listing, token=WRITE_TOKEN) == 200
    body = json.dumps(
        {
            "env": path.read_text(),
            "lock": lock_path(path).read_text(),
            "meta": {
                "name": "exp",
                "hash": version,
                "environment": env_hash(load_spec(path), Lock.parse(lock_path(path).read_text())),
                "pushed-by": "a@b",
                "time": "2026-01-01T00:00:00+00:00",
                "amesh": "0",
                "python": "3",
                "platform": "p",
            },
        }
    ).encode()
    put = f"{server.url}/v1/envs/exp/{version}"
    assert _status(put, "PUT", None, body) == 401
    assert _status(put, "PUT", "wrong-token-0123456789abcdef", body) == 401
    assert _status(put, "PUT", READ_TOKEN, body) == 403
    assert not (server.root / "exp" / version).exists()
    # the CLI says why, and pushes nothing
    assert cli("push", "exp", "--hub", server.url, "--token-file", str(server.read)) == 1
    assert "403" in capsys.readouterr().err
    # a version whose files do not hash to its name, and one too large to take
    assert _status(f"{server.url}/v1/envs/exp/{'0' * 64}", "PUT", WRITE_TOKEN, body) == 400
    huge = body.replace(b'"env": "', b'"env": "' + b"#" * (5 << 20), 1)
    assert _status(put, "PUT", WRITE_TOKEN, huge) == 413
    assert not (server.root / "exp" / version).exists()
    assert _status(put, "PUT", WRITE_TOKEN, body) == 201


@pytest.mark.parametrize(
    "path",
    [
        "/v1/envs/..%2F..%2Fetc/latest",
        "/v1/envs/%2E%2E/latest",
        "/v1/envs/exp/..%2F..%2F..%2Fread.token/env.toml",
        f"/v1/envs/exp/{'0' * 64}/..%2F..%2F..%2Fread.token",
        "/v1/envs/.exp/versions",
    ],
)
def test_the_http_hub_refuses_paths_out_of_it(server: Server, path: str) -> None:
    assert _status(server.url + path, token=READ_TOKEN) in (400, 404)
    assert _status(server.url + path.replace("/latest", "/" + "0" * 64), "PUT", WRITE_TOKEN) in (
        400,
        404,
        405,
    )


def test_no_secret_value_or_token_reaches_a_hub_or_the_log(
    server: Server, project: Path, tmp_path: Path
) -> None:
    assert os.environ[SECRET] == SECRET_VALUE
    path = write_env(project, ("tinysecret",))
    hub = tmp_path / "hub"
    assert cli("push", "exp", "--hub", str(hub)) == 0
    assert cli("push", "exp", "--hub", server.url, "--token-file", str(server.write)) == 0
    assert cli("pull", "exp", "--hub", server.url, "--token-file", str(server.read)) == 0
    assert (server.root / "exp" / version_of(path)).is_dir()
    files = [p for root in (hub, server.root) for p in root.rglob("*") if p.is_file()]
    assert len(files) >= 8
    for file in [*files, server.log]:
        data = file.read_bytes()
        assert SECRET_VALUE.encode() not in data, file
        assert READ_TOKEN.encode() not in data and WRITE_TOKEN.encode() not in data, file
    assert b"PUT /v1/envs/exp/" in server.log.read_bytes()  # (the log is the one written)


def test_hub_serve_refuses_short_tokens_and_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    good = tmp_path / "good"
    good.write_text(WRITE_TOKEN)
    base = ["hub", "serve", str(tmp_path / "hub"), "--listen", "127.0.0.1:0"]
    assert _cli.main([*base, "--read-token-file", str(short), "--write-token-file", str(good)]) == 2
    assert "at least" in capsys.readouterr().err
    missing = str(tmp_path / "none")
    assert _cli.main([*base, "--read-token-file", missing, "--write-token-file", str(good)]) == 2
    assert "cannot read" in capsys.readouterr().err

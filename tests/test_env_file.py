"""The environment file (issue 38, item 1): what it reads, and that every error names
the file, the line and the key; the environment's hash; ``amesh env init`` and ``show``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from amesh import _cli
from amesh._env import (
    EnvError,
    HostsTarget,
    LocalTarget,
    Lock,
    Locked,
    SlurmTarget,
    SshTarget,
    env_hash,
    load_spec,
    parse_spec,
    resolve,
)
from amesh._env._locate import key_lines, line_of, show_path

pytestmark = pytest.mark.timeout(30)

FULL = textwrap.dedent(
    """\
    # a comment
    format = 1
    name = "titan"
    python = ">=3.11,<3.14"
    dependencies = ["torch==2.13.0", "tqdm", 'numpy>=1.26; sys_platform == "linux"']
    env = { OMP_NUM_THREADS = "4" }
    secrets = ["WANDB_API_KEY"]

    [workspace]
    paths = [".", "lib"]
    exclude = ["data/", "*.ckpt"]

    [targets.laptop]
    launcher = "local"
    per_host = { procs = 2 }

    [targets.lab]
    launcher = "hosts"
    agents = ["tcp://10.0.0.1:7000", "stream+tcp://[::1]:7001"]
    key_file = "keys/job.key"

    [targets.cloud]
    launcher = "ssh"
    hosts = ["a.example", "root@b.example"]
    user = "me"

    [targets.cluster]
    launcher = "slurm"
    nodes = 4
    time = "2:00:00"
    partition = "gpu"
    per_host = { gpus = 8 }
    """
)


def test_a_full_file_reads_into_typed_targets(tmp_path: Path) -> None:
    path = tmp_path / "envs" / "titan.toml"
    path.parent.mkdir()
    path.write_text(FULL)
    spec = load_spec(path)
    assert (spec.name, spec.format, spec.python) == ("titan", 1, ">=3.11,<3.14")
    assert spec.dependencies[2] == 'numpy>=1.26; sys_platform == "linux"'
    assert spec.env == {"OMP_NUM_THREADS": "4"} and spec.secrets == ("WANDB_API_KEY",)
    assert spec.workspace.exclude == ("data/", "*.ckpt")
    assert spec.targets["laptop"] == LocalTarget(per_host={"procs": 2})
    lab = spec.targets["lab"]
    assert isinstance(lab, HostsTarget) and lab.per_host == {"procs": 1}
    # paths in the file are relative to its directory, wherever the controller runs
    assert spec.resolve(lab.key_file or "") == path.parent.resolve() / "keys" / "job.key"
    assert spec.targets["cloud"] == SshTarget(hosts=("a.example", "root@b.example"), user="me")
    cluster = spec.targets["cluster"]
    assert isinstance(cluster, SlurmTarget)
    assert (cluster.nodes, cluster.partition, cluster.per_host) == (4, "gpu", {"gpus": 8})


def test_a_minimal_file_takes_the_defaults() -> None:
    spec = parse_spec('name = "x"\n')
    assert (spec.python, spec.dependencies, spec.targets) == ("", (), {})
    assert spec.workspace.paths == ()  # (the project's directory, see workspace_roots)


def test_the_workspace_is_the_project_s_directory_unless_the_file_names_paths(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    (project / "envs").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    in_envs = project / "envs" / "x.toml"
    in_envs.write_text('name = "x"\n')
    assert load_spec(in_envs).workspace_roots() == [project.resolve()]
    in_envs.write_text('name = "x"\n[workspace]\npaths = ["../src", "data.csv"]\n')
    assert load_spec(in_envs).workspace_roots() == [
        project.resolve() / "envs" / "../src",
        project.resolve() / "envs" / "data.csv",
    ]
    alone = tmp_path / "elsewhere" / "amesh.toml"  # no project around it: its folder
    alone.parent.mkdir()
    alone.write_text('name = "y"\n')
    assert load_spec(alone).workspace_roots() == [alone.parent.resolve()]


BAD = {
    "a string for an int": (
        '[targets.cluster]\nlauncher = "slurm"\nnodes = "four"\n',
        '3: targets.cluster.nodes: expected an int, got "four"',
    ),
    "a bool for an int": (
        '[targets.c]\nlauncher = "slurm"\nnodes = true\n',
        "3: targets.c.nodes: expected an int, got true",
    ),
    "an unknown top-level key": (
        'dependecies = ["x"]\n',
        "1: dependecies: unknown key; did you mean 'dependencies'?",
    ),
    "an unknown key of a target": (
        '[targets.c]\nlauncher = "slurm"\nnodes = 2\npartitoin = "gpu"\n',
        "4: targets.c.partitoin: unknown key; did you mean 'partition'?",
    ),
    "a key of another launcher": (
        '[targets.l]\nlauncher = "local"\nnodes = 2\n',
        "3: targets.l.nodes: unknown key",
    ),
    "an unknown launcher": (
        '[targets.c]\nlauncher = "slurrm"\n',
        "2: targets.c.launcher: unknown launcher \"slurrm\"; did you mean 'slurm'?",
    ),
    "no launcher": ("[targets.c]\nnodes = 2\n", "1: targets.c: no launcher"),
    "a bad PEP 508 requirement in a long array": (
        'dependencies = [\n  "tqdm",\n  "torch>>2",\n]\n',
        "3: dependencies[1]: not a PEP 508 requirement ('torch>>2')",
    ),
    "a bad specifier": ('python = "3.11+"\n', "1: python: not a PEP 440 version specifier"),
    "a bad secret name": ('secrets = ["OK", "WANDB-KEY"]\n', '1: secrets[1]: "WANDB-KEY"'),
    "a bad variable name": ('env = { "A B" = "1" }\n', '1: env."A B": not an environment'),
    "a variable's value not a string": ("env = { A = 1 }\n", "1: env.A: expected a string"),
    "a bad per_host size in an inline table": (
        '[targets.l]\nlauncher = "local"\nper_host = { procs = 0 }\n',
        "3: targets.l.per_host.procs: expected a positive int, got 0",
    ),
    "hosts in per_host": (
        '[targets.l]\nlauncher = "local"\nper_host = { hosts = 2 }\n',
        "3: targets.l.per_host.hosts: 'hosts' is the hosts' own dimension",
    ),
    "a dotted key": ('targets.c.launcher = "local"\ntargets.c.per_host = 3\n', "2: targets.c"),
    "a bad agent address": (
        '[targets.h]\nlauncher = "hosts"\nagents = ["10.0.0.1"]\n',
        '3: targets.h.agents[0]: "10.0.0.1" is not of the form',
    ),
    "no agents": ('[targets.h]\nlauncher = "hosts"\n', "1: targets.h: a hosts target needs agents"),
    "a newer format": ("format = 2\n", "1: format: format 2 is newer than this amesh reads (1)"),
    "a bad name": ('name = "Titan!"\n', '1: name: "Titan!" is not of the form'),
    "an array for a table": ("workspace = []\n", "1: workspace: expected a table, got an array"),
    "malformed TOML keeps tomllib's line": (
        "\n\nfoo = = 1\n",
        "3: not valid TOML: ",
    ),
}


@pytest.mark.parametrize("text,expected", list(BAD.values()), ids=list(BAD))
def test_every_error_names_the_file_the_line_and_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "envs" / "bad.toml"
    path.parent.mkdir()
    # the name first (one line), so that the lines of the bad parts are one more
    path.write_text(('name = "bad"\n' if "name =" not in text else "\n") + text)
    line, _, rest = expected.partition(":")
    with pytest.raises(EnvError) as caught:
        load_spec(path)
    assert str(caught.value).startswith(f"{path}:{int(line) + 1}:{rest}"), str(caught.value)


def test_a_missing_name_and_a_missing_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match=r"^f.toml:1: \(the file\): no name"):
        parse_spec('python = ">=3.11"\n', "f.toml")
    with pytest.raises(EnvError, match="cannot read the environment file"):
        load_spec(tmp_path / "none.toml")


def _lock(*pins: str) -> Lock:
    return Lock(
        env="titan",
        python="3.11",
        platform="linux-x86_64",
        amesh="",
        inputs="0" * 64,
        requirements=tuple(Locked(p.split("==")[0], p.split("==")[1], ("a" * 64,)) for p in pins),
    )


def test_the_hash_changes_with_dependencies_not_with_targets_or_secret_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = parse_spec(FULL, "a/titan.toml")
    lock = _lock("tqdm==4.67.1")
    first = env_hash(base, lock)
    assert len(first) == 64 and first == env_hash(parse_spec(FULL, "elsewhere.toml"), lock)
    no_targets = FULL[: FULL.index("[targets.laptop]")]
    assert env_hash(parse_spec(no_targets), lock) == first
    monkeypatch.setenv("WANDB_API_KEY", "s3cret")  # a secret's value is never read
    assert env_hash(base, lock) == first
    more = FULL.replace('"tqdm"', '"tqdm", "rich"')
    assert env_hash(parse_spec(more), lock) != first
    assert env_hash(base, _lock("tqdm==4.67.2")) != first
    assert env_hash(parse_spec(FULL.replace('"4"', '"8"')), lock) != first


def test_the_lock_text_round_trips() -> None:
    lock = _lock("tqdm==4.67.1", "rich==13.0")
    assert Lock.parse(lock.text()) == lock
    assert Lock.parse(lock.text()).text() == lock.text()
    with pytest.raises(EnvError, match=r"^x.lock:1: not an amesh lock"):
        Lock.parse("tqdm==1\n", "x.lock")
    with pytest.raises(EnvError, match="has no --hash"):
        Lock.parse(lock.text().split(" \\\n")[0] + "\n")


def test_init_writes_a_file_from_pyproject_and_never_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "My_Project"\nrequires-python = ">=3.10"\n'
        'dependencies = ["tqdm>=4", "rich"]\n'
    )
    assert _cli.main(["env", "init"]) == 0
    spec = load_spec(tmp_path / "amesh.toml")
    assert (spec.name, spec.python, spec.dependencies) == (
        "my_project",
        ">=3.10",
        ("tqdm>=4", "rich"),
    )
    assert spec.targets == {"local": LocalTarget(per_host={"procs": 2})}
    before = (tmp_path / "amesh.toml").read_text()
    assert _cli.main(["env", "init", "--name", "other"]) == 1
    assert "exists, and init never overwrites one" in capsys.readouterr().err
    assert (tmp_path / "amesh.toml").read_text() == before


def test_init_from_a_requirements_file_names_a_bad_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "req.txt").write_text("# pinned\ntqdm==4.67.1  # why\n-e .\n")
    assert _cli.main(["env", "init", "--name", "exp", "--from", "req.txt"]) == 0
    assert load_spec(tmp_path / "amesh.toml").dependencies == ("tqdm==4.67.1",)
    assert "req.txt:3: option '-e .' left out" in capsys.readouterr().err
    (tmp_path / "amesh.toml").unlink()
    (tmp_path / "bad.txt").write_text("tqdm\ntorch>>2\n")
    assert _cli.main(["env", "init", "--from", "bad.txt"]) == 1
    assert "bad.txt:2: not a PEP 508 requirement" in capsys.readouterr().err
    assert not (tmp_path / "amesh.toml").exists()


def test_show_and_check_never_print_a_secret_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "titan.toml").write_text(FULL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "s3cret-value")
    assert _cli.main(["env", "show", "titan"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-value" not in out
    assert "secrets: WANDB_API_KEY (set here)" in out
    assert "hash: none: there is no lock" in out
    assert "cluster: slurm, per host {gpus = 8}" in out
    assert "ssh root@b.example, python python3" in out and "ssh me@a.example" in out
    # check: a missing lock is a problem to fix (exit 1); the hosts are listed
    assert _cli.main(["env", "check", "titan", "--target", "cloud"]) == 1
    out = capsys.readouterr().out
    assert "ssh root@b.example, python python3" in out and "laptop" not in out
    assert "hosts not asked: the ssh launcher starts their agents at spawn" in out
    assert _cli.main(["env", "check", "titan", "--target", "nope"]) == 1
    assert "no target 'nope' (the targets: laptop, lab, cloud, cluster)" in capsys.readouterr().err


def test_the_documented_example_reads() -> None:
    page = (Path(__file__).parent.parent / "docs" / "guides" / "environments.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    spec = parse_spec(example, "envs/titan.toml")
    assert sorted(spec.targets) == ["cloud", "cluster", "lab", "laptop"]
    # the documented error's line is the line of nodes in the documented example
    with pytest.raises(EnvError) as caught:
        parse_spec(example.replace("nodes = 4", 'nodes = "four"'), "envs/titan.toml")
    assert f"{caught.value}" in page


def test_the_locator_skips_strings_and_comments_and_reads_inline_tables() -> None:
    text = textwrap.dedent(
        '''\
        name = "x"  # [not.a.table]
        notes = """
        [targets.fake]
        nodes = 1
        """
        "quoted key".inner = 'it''s'
        [targets."my box"]
        launcher = "local"
        per_host = { procs = 2, "gpus" = [1, 2] }
        [[runs]]
        a = 1
        [[runs]]
        a = [
          { b = 2 },
          3,
        ]
        '''
    )
    lines = key_lines(text)
    assert ("targets", "fake") not in lines
    assert lines[("quoted key", "inner")] == 6
    assert lines[("targets", "my box", "per_host", "gpus", 1)] == 9
    assert lines[("runs", 1, "a", 0, "b")] == 14
    assert lines[("runs", 1, "a", 1)] == 15
    assert line_of(lines, ("targets", "my box", "nodes")) == 7
    assert show_path(("targets", "my box", "per_host")) == 'targets."my box".per_host'


def test_a_python_this_controller_does_not_run_is_refused_before_resolving() -> None:
    spec = parse_spec('name = "x"\npython = "<3.0"\n', "x.toml")
    with pytest.raises(EnvError, match=r"x.toml: python: this controller's Python .* '<3.0'"):
        resolve(spec, include_amesh=False, no_index=True)

"""amesh's settings: one definition, read from the environment (``AMESH_*``) or given
in code (:func:`configure`), validated in one place.

:class:`Settings` has one field per user-facing setting; its variable is ``AMESH_``
and the field's name in capitals. :func:`settings` parses the environment once, at
first use, and again after :func:`reset` (a zygote's child taking its own environment,
the test plugin between tests); values given to :func:`configure` win over the
environment. A bad value raises :class:`ConfigError`, which names the variable (or the
setting) and the value.

Settings travel with what they configure: a mesh gives its workers, in their
:class:`~amesh._bootstrap.WorkerSpec`, the values given to :func:`configure` under its
own (``ProcMesh(settings=)``, checked by :func:`for_mesh`; :func:`for_workers` merges
them), typed, never as variables of their environment; a worker adopts them
(:func:`adopt`) before anything reads its settings. So two meshes of one controller may
differ in the settings a mesh may set (``mesh=True`` in their rule, the table's "Per"
column); the others (the transport, files and directories, keys) belong to each
process.

Some ``AMESH_*`` variables are amesh's own plumbing, set for its children
(:data:`INTERNAL`): they are not settings, and :func:`take_internal` reads them.

:func:`table` is the table of ``docs/guides/configuration.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INTERNAL",
    "VARIABLES",
    "ConfigError",
    "Settings",
    "adopt",
    "configure",
    "debug",
    "default_transport",
    "for_mesh",
    "for_workers",
    "heartbeats",
    "is_set",
    "loop_options",
    "reset",
    "settings",
    "table",
    "take_internal",
    "unknown_variables",
    "warn_unknown",
]

#: Variables amesh sets for its own children, never settings of a user.
INTERNAL = (
    "AMESH_DEBUG_LISTENER",
    "AMESH_DEBUG_RELAYED",
    "AMESH_ZYGOTE_BOOT",
)

#: ``AMESH_*`` variables that are known but not amesh's: its test suite's and scripts'
#: (``AMESH_TEST_*``, ``AMESH_SLURM_*`` of scripts/cluster) and the C extension's
#: build switch; :func:`warn_unknown` does not take them for misspelt settings.
_NOT_SETTINGS = (
    "AMESH_CLUSTER_TESTS",
    "AMESH_EXT_DEBUG",
    "AMESH_FAULTS_PROFILE",
    "AMESH_NEWER_PYTHON",
)
_NOT_SETTINGS_PREFIXES = ("AMESH_TEST_", "AMESH_SLURM_")

_MIB = 1 << 20
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: the standard library's levels; "": each process its own default
_LEVELS = ("", "CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


class ConfigError(ValueError):
    """An amesh setting (an ``AMESH_*`` variable or a :func:`amesh.configure`
    argument) has a value it cannot take; the message names both."""


@dataclass(frozen=True)
class _Rule:
    """What one setting accepts, beyond its type."""

    doc: str
    minimum: float | None = None
    #: values below ``minimum`` are refused; above ``above`` only (exclusive)
    above: float | None = None
    choices: tuple[str, ...] = ()
    #: a check of its own, and what it says (``"0 or an integer >= 2"``)
    check: Callable[[Any], bool] | None = None
    says: str = ""
    #: the default as the table shows it, when not the value itself
    shown: str = ""
    #: whether a mesh may set it for its own workers (``ProcMesh(settings=)``); the
    #: others belong to a process as a whole (its transport, its files, its key)
    mesh: bool = False


def _setting(default: Any, doc: str, **rule: Any) -> Any:
    return field(default=default, metadata={"rule": _Rule(doc, **rule)})


def _fanout_ok(n: int) -> bool:
    return n == 0 or n >= 2


@dataclass(frozen=True)
class Settings:
    """The effective settings of this process (see :func:`settings`)."""

    transport: str = _setting(
        "",
        "How processes talk: `auto` (abstract sockets on Linux, else ipc; one host), "
        "`abstract`, `ipc`, `tcp` (= `tls+tcp`: TLS between hosts, streams within one) "
        "or `stream+tcp` (plain streams, authenticated by the job key, not encrypted); "
        "`stream+abstract`, `stream+ipc`: streams whatever `AMESH_TRANSPORT_IMPL` says.",
        choices=(
            "",
            "auto",
            "abstract",
            "ipc",
            "tcp",
            "tls+tcp",
            "stream+tcp",
            "stream+abstract",
            "stream+ipc",
        ),
        shown="`auto` (`tcp` when `AMESH_HOST` is set)",
    )
    host: str = _setting(
        "",
        "The address the controller listens on for tcp (its address on the network "
        "other machines reach).",
        shown="`127.0.0.1`",
    )
    transport_impl: str = _setting(
        "stream",
        "What carries the frames: `stream` (event-loop sockets) or `ext` (NNG, through "
        "the C extension where it is built); `nng` (once pure pynng) now means the same "
        "NNG transport as `ext`.",
        choices=("stream", "ext", "nng"),
    )
    fanout: int = _setting(
        16,
        "Calls and broadcasts to more processes than this go down a relay tree with "
        "this fan-out; 0: every rank directly (`ProcMesh(fanout=)`).",
        check=_fanout_ok,
        says="0 (no relay tree) or an integer >= 2",
        mesh=True,
    )
    heartbeat_period: float = _setting(
        0.5,
        "Seconds between a worker's heartbeats (`ProcMesh(heartbeat_period=)`). Unset, a "
        "mesh of N > 256 processes takes N/512 s, so that its controller hears at most "
        "about 512 heartbeats a second.",
        above=0,
        mesh=True,
    )
    heartbeat_timeout: float = _setting(
        5.0,
        "A worker silent this many seconds is declared failed and killed "
        "(`ProcMesh(heartbeat_timeout=)`); more than the period. Unset, at least 4 "
        "periods.",
        above=0,
        mesh=True,
    )
    send_window: int = _setting(
        1024,
        "Messages one sender may have waiting in one actor's mailbox before it waits "
        "(at least 2 x the credit batch of 32).",
        minimum=64,
        mesh=True,
    )
    send_window_bytes: int = _setting(
        256 * _MIB,
        "Bytes one sender may have waiting in one actor's mailbox (at least 16 MiB).",
        minimum=16 * _MIB,
        shown="`268435456` (256 MiB)",
        mesh=True,
    )
    shm_threshold: int = _setting(
        _MIB,
        "With `shm=True`, buffers of this many bytes or more go through shared memory "
        "(below 64 KiB counts as 64 KiB).",
        minimum=0,
        shown="`1048576` (1 MiB)",
        mesh=True,
    )
    shm_dir: str = _setting("/dev/shm", "Where shared-memory segments go.", shown="`/dev/shm`")
    ipc_dir: str = _setting("", "Where `ipc://` socket files go.", shown="`$TMPDIR/amesh-<uid>`")
    state_dir: str = _setting(
        "",
        "The local agent's files, the registry of live meshes and the key of persistent meshes.",
        shown="`~/.cache/amesh`",
    )
    jobs_dir: str = _setting("", "Where Slurm jobs are recorded.", shown="`~/.cache/amesh/jobs`")
    cache_dir: str = _setting(
        "",
        "The controller's cache of environments: the wheels of their locks (`wheels/`, "
        "content-addressed) and uv's cache (`uv/`).",
        shown="`~/.cache/amesh`",
    )
    depot_dir: str = _setting(
        "",
        "Where a host agent keeps environments: the wheels and workspace files sent to "
        "it, a venv per environment and a tree per workspace version.",
        shown="`~/.cache/amesh/depot`",
    )
    hub: str = _setting(
        "",
        "The hub that `amesh env push`, `pull` and `list` use without `--hub`: a "
        "directory (a shared filesystem, a git checkout) or the `http(s)://` URL of an "
        "`amesh hub serve`.",
        shown="-",
    )
    hub_token_file: str = _setting(
        "",
        "The file holding the token sent to an HTTP hub (its read token to pull, its "
        "write token to push).",
        shown="-",
    )
    key_file: str = _setting(
        "",
        "The job key (from `amesh keygen`).",
        shown="a fresh key per controller",
    )
    tls_ca: str = _setting(
        "",
        "The CA file(s) of `tls+tcp` links; with `AMESH_TLS_CERT` and `AMESH_TLS_KEY`, "
        "all three or none.",
        shown="certificates derived from the job key",
    )
    tls_cert: str = _setting("", "This process's certificate (chain) file, PEM.", shown="-")
    tls_key: str = _setting("", "The private key file of `AMESH_TLS_CERT`, PEM.", shown="-")
    tls_server_name: str = _setting("amesh", "The name dialers check in a listener's certificate.")
    handshake_timeout: float = _setting(
        5.0,
        "Seconds a host agent gives a connection, from its accept, to finish its TLS "
        "handshake and prove the job key; then it is closed.",
        above=0,
    )
    local_agent_idle: float = _setting(
        30.0,
        "Seconds the local agent lives on without workers or controllers; "
        "0: it never exits by itself.",
        minimum=0,
    )
    debug: bool = _setting(
        False,
        "Tracebacks keep amesh's own frames (which they leave out: remote ones, and those "
        "a controller prints).",
        mesh=True,
    )
    pause_anywhere: bool = _setting(
        False,
        "Run every handler in a greenlet of its own, so that a `breakpoint()` anywhere "
        "in the code it calls pauses that handler only (off: only endpoints whose own "
        "code calls `breakpoint()` or `pdb.set_trace()`, and those that paused once; "
        "about 10 µs more per call).",
        mesh=True,
    )
    backend: str = _setting(
        "asyncio", "The event loop of `amesh.run`.", choices=("asyncio", "trio")
    )
    zygote: bool = _setting(
        True,
        "Fork workers from a zygote, which has done the imports already (Linux); "
        "off: exec each worker fresh.",
    )
    zygote_immortal: bool = _setting(
        True,
        "On CPython 3.12 and 3.13, the zygote makes what it has loaded immortal (PEP 683) "
        "before it forks, so that a worker does not copy the pages of the reference counts "
        "of what it runs (a third fewer pages, ~2 MiB less memory a worker); those objects "
        "are then never freed, in the zygote or its workers.",
    )
    log_level: str = _setting(
        "",
        "The logging level of workers and host agents.",
        choices=_LEVELS,
        shown="`WARNING` (workers), `INFO` (host agents)",
        mesh=True,
    )
    output: str = _setting(
        "folded",
        "What becomes of the workers' output: `folded`, `raw` or `off` (`ProcMesh(output=)`).",
        choices=("folded", "raw", "off"),
        mesh=True,
    )
    log_file_bytes: int = _setting(
        4 * _MIB,
        "Bytes of output each worker of a persistent mesh keeps in its log file at its "
        "host agent (`amesh logs`), and as much again in one rotated file.",
        minimum=4096,
        shown="4 MiB",
        mesh=True,
    )


def _var(name: str) -> str:
    return "AMESH_" + name.upper()


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_TYPES: dict[str, type] = {name: typing.get_type_hints(Settings)[name] for name in _FIELDS}
#: The environment variables of the settings, in the order of their fields.
VARIABLES = tuple(_var(name) for name in _FIELDS)


def _rule(name: str) -> _Rule:
    rule: _Rule = _FIELDS[name].metadata["rule"]
    return rule


def _says(name: str) -> str:
    """What ``name`` accepts, in words (``"an integer >= 64"``)."""
    rule, kind = _rule(name), _TYPES[name]
    if rule.says:
        return rule.says
    if rule.choices:
        return "one of " + ", ".join(repr(c) for c in rule.choices if c)
    if kind is bool:
        return "a boolean (1/0, true/false, yes/no, on/off)"
    noun = {int: "an integer", float: "a number", str: "a string"}[kind]
    if rule.above is not None:
        return f"{noun} > {rule.above:g}"
    if rule.minimum is not None:
        return f"{noun} >= {int(rule.minimum) if kind is int else f'{rule.minimum:g}'}"
    return noun


def _valid(name: str, value: Any) -> bool:
    rule = _rule(name)
    if rule.choices and value not in rule.choices:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if rule.minimum is not None and value < rule.minimum:
        return False
    if rule.above is not None and value <= rule.above:
        return False
    return rule.check is None or rule.check(value)


def _normal(name: str, text: str) -> str:
    """A string setting as amesh compares it (logging levels in capitals)."""
    return text.upper() if name == "log_level" else text


def _parse(name: str, raw: str) -> Any:
    """The value of setting ``name`` that its variable's text ``raw`` gives.

    Raises:
        ConfigError: it is not one ``name`` takes.
    """
    kind, text = _TYPES[name], raw.strip()
    value: Any = None
    if kind is bool:
        if text.lower() in _TRUE + _FALSE:
            value = text.lower() in _TRUE
    elif kind is str:
        value = _normal(name, raw)
    else:
        with contextlib.suppress(ValueError):
            value = kind(text)
    if value is None or not _valid(name, value):
        raise ConfigError(f"{_var(name)} must be {_says(name)}, not {raw!r}")
    return value


def _check(name: str, value: Any) -> Any:
    """``value`` given in code for setting ``name``, validated (a path becomes a str).

    Raises:
        ConfigError: it is not one ``name`` takes.
    """
    kind, given = _TYPES[name], value
    if kind is str and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if kind is str and isinstance(value, str):
        value = _normal(name, value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    typed = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not typed or not _valid(name, value):
        raise ConfigError(f"{name} ({_var(name)}) must be {_says(name)}, not {given!r}")
    return value


def _text(value: Any) -> str:
    """A value as its variable holds it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return repr(value) if isinstance(value, float) else str(value)


_overrides: dict[str, Any] = {}
_cache: Settings | None = None


def settings() -> Settings:
    """This process's settings: its ``AMESH_*`` variables, parsed once, at first use,
    under those given to :func:`configure` (which parses them again). A variable set
    later in this process counts only after :func:`reset`.

    Raises:
        ConfigError: a variable has a bad value.
    """
    global _cache
    current = _cache
    if current is not None:
        return current
    values = {
        name: _parse(name, raw)
        for name, raw in zip(_FIELDS, map(os.environ.get, VARIABLES))
        if raw and name not in _overrides
    }
    current = _cache = Settings(**values, **_overrides)
    return current


def configure(**values: Any) -> None:
    """Set amesh settings in code, e.g. ``amesh.configure(fanout=4)``: they win over
    the environment here and reach the worker processes started afterwards, in their
    spec (a ProcMesh's arguments, its ``settings=`` and the variables of its ``env=``
    win over them). ``None`` gives a setting
    back to the environment. Call it before starting meshes. The settings are the
    fields of :class:`Settings` (``docs/guides/configuration.md``).

    Raises:
        ConfigError: an unknown setting, or a value it cannot take (nothing is set).
    """
    _known(values)
    checked = {name: _check(name, v) for name, v in values.items() if v is not None}
    for name, value in values.items():
        if value is None:
            _overrides.pop(name, None)
    _overrides.update(checked)
    reset(overrides=False)


def _known(names: Iterable[str]) -> None:
    """Check that each of ``names`` is a setting.

    Raises:
        ConfigError: one is not (the message lists the settings).
    """
    unknown = sorted(set(names) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"no amesh setting {', '.join(unknown)}; the settings are: {', '.join(_FIELDS)}"
        )


def reset(*, overrides: bool = True) -> None:
    """Forget the parsed settings (the next :func:`settings` reads the environment
    again: after a change to it in this process), and unless not ``overrides``, those
    given to :func:`configure` (for tests)."""
    global _cache
    _cache = None
    if overrides:
        _overrides.clear()


#: an unset heartbeat period stretches past this many processes in one mesh
HEARTBEATS_PER_SECOND = 512


def heartbeats(
    processes: int, period: float | None = None, timeout: float | None = None
) -> tuple[float, float]:
    """``(period, timeout)`` of the heartbeats of a mesh of ``processes``: the values
    given (a ProcMesh's arguments, or its ``settings=``), else those set
    (:func:`configure`, ``AMESH_*``), else defaults that keep the controller's load
    bounded: a period of at least ``processes / 512`` s (0.5 s up to 256 processes) and
    a timeout of at least 4 periods (5 s up to 1.25 s periods).

    Raises:
        ConfigError: the period is not > 0, or the timeout not more than the period;
            the message says where each value came from.
    """
    config = settings()
    given_period, given_timeout = period is not None, timeout is not None
    if period is None:
        period = config.heartbeat_period
        if not is_set("heartbeat_period"):
            period = max(period, processes / HEARTBEATS_PER_SECOND)
    if timeout is None:
        timeout = config.heartbeat_timeout
        if not is_set("heartbeat_timeout"):
            timeout = max(timeout, 4 * period)
    if not period > 0:  # (a variable's or configure's was refused by its own rule)
        raise ConfigError(f"heartbeat_period={period!r} (ProcMesh's argument) must be a number > 0")
    if not timeout > period:
        said = _source("heartbeat_period", period, given_period)
        if not given_period and not is_set("heartbeat_period"):
            stretched = period > config.heartbeat_period
            said = f"{period:g} s, the default" + (
                f" for {processes} processes" if stretched else ""
            )
        raise ConfigError(
            f"{_source('heartbeat_timeout', timeout, given_timeout)} must be more than the "
            f"heartbeat period ({said}): a number > {period:g}"
        )
    return period, timeout


def _source(name: str, value: float, given: bool) -> str:
    """How an error names setting ``name``, ``value``: as its origin spells it (a
    ProcMesh's argument if ``given``, :func:`configure`'s, or its variable's)."""
    if given:
        return f"{name}={value!r} (ProcMesh's argument)"
    if name in _overrides:
        return f"{name}={value!r} (amesh.configure)"
    var = _var(name)
    return f"{var}={os.environ.get(var, '')}"


def is_set(name: str) -> bool:
    """Whether setting ``name`` was given (:func:`configure`, or its variable)."""
    return name in _overrides or bool(os.environ.get(_var(name)))


_warned: set[str] = set()


def unknown_variables() -> list[str]:
    """What to say of each ``AMESH_*`` variable of the environment that is no setting
    (a misspelt one would be ignored silently), once a process: that it is ignored, and
    the closest setting. Called where a program starts using amesh (a ProcMesh, the
    ``amesh`` command), not by :func:`settings`: amesh's children inherit the variables,
    and would say it again."""
    known = (*VARIABLES, *INTERNAL, *_NOT_SETTINGS)
    said = []
    for var in sorted(os.environ):
        if (
            not var.startswith("AMESH_")
            or var in known
            or var.startswith(_NOT_SETTINGS_PREFIXES)
            or var in _warned
        ):
            continue
        _warned.add(var)
        # (the names without their common prefix, which would make any two look alike)
        close = difflib.get_close_matches(var[6:].lower(), _FIELDS, n=1)
        hint = f"; did you mean {_var(close[0])}?" if close else ""
        said.append(
            f"{var} is not an amesh setting, and is ignored{hint} "
            "(the settings: docs/guides/configuration.md)"
        )
    return said


def warn_unknown(stacklevel: int = 1) -> None:
    """:func:`unknown_variables` as Python warnings; ``stacklevel``: that of the
    caller's caller, whose line they show."""
    for text in unknown_variables():
        warnings.warn(text, stacklevel=stacklevel + 1)


def for_mesh(values: Mapping[str, Any], given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``values`` a mesh gives its workers (``ProcMesh(settings=)``), checked as
    :func:`configure` checks its own; ``given``: the settings the mesh also takes as
    arguments (``ProcMesh(fanout=...)``), None where not given.

    Raises:
        ConfigError: an unknown setting, one that belongs to a whole process (its
            transport, a file: :func:`configure` or its variable sets it), or a value
            it cannot take; the message names the setting. Or one is given twice: as
            an argument and in ``values``.
    """
    _known(values)
    for name, value in (given or {}).items():
        if value is not None and name in values and values[name] is not None:
            raise ConfigError(f"{name} is given twice: as an argument and in settings=")
    for name in values:
        if not _rule(name).mesh:
            mine = ", ".join(n for n in _FIELDS if _rule(n).mesh)
            raise ConfigError(
                f"{name} ({_var(name)}) belongs to a whole process, not to one mesh: set it "
                f"with amesh.configure or its variable; a mesh sets only {mine}"
            )
    return {name: _check(name, v) for name, v in values.items() if v is not None}


def for_workers(mesh: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The settings the workers of a mesh adopt (:func:`adopt`): those given to
    :func:`configure` in this process, but those its environment ``env`` sets as
    variables (a mesh's ``env=``, which wins over them), under the mesh's own
    ``mesh`` (checked by :func:`for_mesh`)."""
    return {
        **{name: v for name, v in _overrides.items() if _var(name) not in env},
        **mesh,
    }


def adopt(values: Mapping[str, Any]) -> None:
    """In a worker, at its start: the settings of its spec (:func:`for_workers`) are
    this process's overrides, as if given to :func:`configure`, and only they: a
    zygote's child keeps none of the zygote's.

    Raises:
        ConfigError: an unknown setting or a bad value (a spec from elsewhere).
    """
    if values == _overrides:  # (none, mostly: a forked child keeps its parsed settings)
        return
    _known(values)
    checked = {name: _check(name, v) for name, v in values.items()}
    _overrides.clear()
    _overrides.update(checked)
    reset(overrides=False)


def take_internal(var: str, *, keep: bool = False) -> str:
    """Variable ``var`` of :data:`INTERNAL`, which amesh set for this process ("" when
    unset), removed from the environment (not passed on to children) unless ``keep``."""
    if var not in INTERNAL:
        raise KeyError(f"{var} is not one of amesh's own variables")
    return os.environ.get(var, "") if keep else os.environ.pop(var, "")


def default_transport() -> tuple[str, str]:
    """``(scheme, host)`` from ``AMESH_TRANSPORT`` and ``AMESH_HOST`` (default
    127.0.0.1): ``auto`` without a host, ``tcp`` (encrypted between hosts) with one.
    See :func:`amesh._transport.open_transport`."""
    s = settings()
    # an address given for other machines to reach: tcp (encrypted between hosts)
    return s.transport or ("tcp" if s.host else "auto"), s.host or "127.0.0.1"


def debug() -> bool:
    """``AMESH_DEBUG``: tracebacks keep amesh's own frames, which they leave out (remote
    ones, and those a controller prints: :func:`amesh._tracebacks.hide_amesh_frames`)
    by default. A worker adopts :func:`configure`'s and its mesh's
    (``ProcMesh(settings={"debug": True})``), else reads its environment (a local one
    inherits the controller's; one on another host, its agent's)."""
    return settings().debug


def loop_options(backend: str) -> dict[str, object]:
    """``backend_options`` for ``anyio.run``: uvloop for asyncio when it is installed."""
    if backend != "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def table() -> str:
    """The Markdown table of the settings: variable, type, default, whether a mesh
    may set it for its workers or it belongs to each process, meaning."""
    rows = ["| Variable | Type | Default | Per | Meaning |", "| --- | --- | --- | --- | --- |"]
    for name, f in _FIELDS.items():
        rule = _rule(name)
        default = rule.shown or f"`{_text(f.default)}`"
        if rule.choices:
            accepts = " \\| ".join(f"`{c}`" for c in rule.choices if c)
        else:
            accepts = (
                _says(name).replace(" (no relay tree)", "").removeprefix("a ").removeprefix("an ")
            )
        per = "mesh" if rule.mesh else "process"
        rows.append(f"| `{_var(name)}` | {accepts} | {default} | {per} | {rule.doc} |")
    return "\n".join(rows) + "\n"

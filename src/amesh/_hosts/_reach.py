"""Host agent addresses: checked as the user types them, and why an agent cannot be
reached, found out from outside.

An agent refuses a peer that does not prove it holds the job key and tells it nothing
more: a refusal is a closed connection (an attacker learns no more than that). So when
an agent cannot be reached, the controller finds out why by itself, with what anyone
may do: resolve the name, connect, and (``tls+tcp``) check the certificate the agent
shows every client against this job's CA. A certificate of another CA means the agent
holds another key; one of this job whose agent still refused our proof means it knows
itself by another address (the proof is bound to the address dialled: a missing or
wrong tag, or a name where it listens on an address).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from .._config import settings
from .._transport import CHALLENGE_LEN

if TYPE_CHECKING:
    from .._transport import Material

__all__ = ["PROBE_TIMEOUT", "AgentAddress", "parse_agent_address", "resolves", "why_unreachable"]

#: Seconds each step of finding out why an agent cannot be reached may take.
PROBE_TIMEOUT = 5.0
_SCHEMES = {"tcp": "tls+tcp", "tls+tcp": "tls+tcp", "stream+tcp": "stream+tcp"}
_TAG = re.compile(r"[0-9a-f]{12}\Z")
_FORM = (
    "a host agent's address is tcp://ADDR:PORT (encrypted) or stream+tcp://ADDR:PORT "
    "(plain), followed by /TAG when the agent's address has one"
)


@dataclass(frozen=True)
class AgentAddress:
    """A host agent's address, as typed and as dialled."""

    #: what the user typed
    typed: str
    #: ``tls+tcp`` or ``stream+tcp``
    scheme: str
    #: the host, without IPv6 brackets
    host: str
    port: int
    #: the tag after the port ("": none)
    tag: str = ""

    @property
    def where(self) -> str:
        """``HOST:PORT`` (``[HOST]:PORT`` for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def dial(self) -> str:
        """The agent's runtime address: what the controller sends to and proves itself
        to."""
        return f"{self.scheme}://{self.where}" + (f"/{self.tag}" if self.tag else "")


def parse_agent_address(addr: str) -> AgentAddress:
    """Check a host agent's address as typed (``tcp://ADDR:PORT[/TAG]``, or
    ``tls+tcp://``, ``stream+tcp://``).

    Raises:
        ValueError: it is not one; the message names ``addr`` and what is wrong.
    """
    scheme, sep, rest = addr.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ValueError(f"{addr!r}: {_FORM}")
    hostport, slash, tag = rest.partition("/")
    if slash and not _TAG.match(tag):
        raise ValueError(
            f"{addr!r}: the tag after the port is 12 hex digits, as the agent's address "
            f"shows it (its log, or the file of --announce), not {tag!r}"
        )
    if hostport.startswith("["):
        host, bracket, port = hostport[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise ValueError(f"{addr!r}: an IPv6 host is written [ADDR]:PORT")
        port = port[1:]
    else:
        host, colon, port = hostport.rpartition(":")
        if not colon:
            raise ValueError(f"{addr!r}: no port: {_FORM}")
        if ":" in host:
            raise ValueError(f"{addr!r}: an IPv6 host is written [ADDR]:PORT")
    if not host:
        raise ValueError(f"{addr!r}: no host: {_FORM}")
    if not port.isdigit():
        raise ValueError(f"{addr!r}: the port must be a number, not {port!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{addr!r}: port {int(port)} is out of range (1 to 65535)")
    return AgentAddress(addr, _SCHEMES[scheme], host, int(port), tag)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolves(addr: AgentAddress) -> bool:
    """Whether ``addr``'s host is an IP address or a name that resolves (asked before
    dialling, so that a name that does not is told at once, as such)."""
    if _is_ip(addr.host):
        return True
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            return bool(await anyio.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM))
    except (OSError, TimeoutError):
        return False


def _key_named() -> str:
    path = settings().key_file
    return f"key file {path}" if path else "no key file: this controller made a key of its own"


async def why_unreachable(addr: AgentAddress, key_file: str | None) -> str:
    """What to say after "the agent at ADDR": why it cannot be reached or refused this
    controller, as far as a look from outside tells. ``key_file``: the one the user
    gave, if any (else ``AMESH_KEY_FILE``'s, or none)."""
    key = f"key file {key_file}" if key_file else _key_named()
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            found = await anyio.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot be reached: cannot resolve {addr.host!r} ({exc.strerror})"
    except TimeoutError:
        return f"cannot be reached: cannot resolve {addr.host!r} within {PROBE_TIMEOUT:g} s"
    ip = str(found[0][4][0])
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            stream = await anyio.connect_tcp(ip, addr.port)
    except TimeoutError:
        return (
            f"cannot be reached: {addr.where} did not answer within {PROBE_TIMEOUT:g} s "
            "(the host is down, or a firewall drops the connection)"
        )
    except OSError as exc:
        # (anyio says "All connection attempts failed", from the attempt's own error)
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        if isinstance(cause, ConnectionRefusedError):
            return f"cannot be reached: nothing listens on {addr.where} (connection refused)"
        return f"cannot be reached: cannot connect to {addr.where} ({cause.strerror or cause})"
    async with stream:
        if addr.scheme == "tls+tcp":
            answered = await _shows_our_ca(stream)
        else:
            answered = await _challenges(stream)
    if answered is None:
        return (
            f"accepted the connection but did not answer within {PROBE_TIMEOUT:g} s "
            "(it is stopped, or overloaded)"
        )
    if not answered:
        return f"refused this controller: it holds another key ({key})"
    if addr.scheme == "stream+tcp":  # the refusal says no more: either may be wrong
        return (
            f"refused this controller: it holds another key ({key}), or its address is "
            f"not {addr.dial} ({_another_address(addr, ip)})"
        )
    return f"refused this controller: it holds our key, but {_another_address(addr, ip)}"


def _another_address(addr: AgentAddress, ip: str) -> str:
    if addr.tag:
        return (
            f"tag mismatch: its address does not end in /{addr.tag} (copy the address "
            "it logged, or wrote to the file of --announce)"
        )
    if not _is_ip(addr.host):
        return (
            f"it listens on an address, not on the name {addr.host!r}: give that address "
            f"(tcp://{ip}:{addr.port}, say), with its /TAG if it has one"
        )
    return (
        "tag mismatch: its address ends in a /TAG (it listens on a port the kernel picked): "
        "copy the address it logged, or wrote to the file of --announce"
    )


def _load_own_certificate(ctx: ssl.SSLContext, material: Material) -> None:
    """Load this process's certificate and key into ``ctx`` through a memory file (the
    key never touches a disk), so that the listener finishes its handshake; nothing
    where there are no memory files (the listener then refuses us after its own
    certificate, which is all this looks at)."""
    if not hasattr(os, "memfd_create"):
        return
    fd = os.memfd_create("amesh-probe", os.MFD_CLOEXEC)
    try:
        os.write(fd, (material.cert + material.key).encode())
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


async def _shows_our_ca(stream: anyio.abc.SocketStream) -> bool | None:
    """Whether the TLS listener on ``stream`` shows a certificate of this job's CA;
    None when it does not finish its handshake in time."""
    from .._transport import tls_material  # pynng: only a controller that dials TLS needs it

    material = tls_material()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=material.ca)
    _load_own_certificate(ctx, material)
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            tls = await TLSStream.wrap(stream, hostname=material.server_name, ssl_context=ctx)
    except ssl.SSLCertVerificationError:
        return False
    except TimeoutError:
        return None
    except (ssl.SSLError, OSError, anyio.BrokenResourceError, anyio.EndOfStream):
        # its certificate passed (it comes first); the listener refused ours after
        return True
    with contextlib.suppress(Exception):
        await tls.aclose()
    return True


async def _challenges(stream: anyio.abc.SocketStream) -> bool | None:
    """Whether a plain stream listener sends an amesh challenge; None when it sends
    nothing in time, False when it closes the connection without one."""
    data = b""
    with anyio.move_on_after(PROBE_TIMEOUT):
        try:
            while len(data) < CHALLENGE_LEN:
                data += await stream.receive(CHALLENGE_LEN - len(data))
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return False
        return True
    return None

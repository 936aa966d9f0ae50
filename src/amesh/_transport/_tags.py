"""Addresses that name one process, not a port: the incarnation tag of a tcp address.

An amesh address is a process's identity: a peer that learnt that the process at an
address is gone keeps that address among the dead, and sends nothing there again. A
unix socket's name is unique (it holds the pid and a random part), but a tcp port
that the kernel picked for one process is soon picked again for another, and the new
process would then be taken for the dead one (its calls time out: the replies are
never sent), or get frames meant for the old one.

So a tcp listener on a port the kernel chose adds a tag of 48 random bits to its
address as a path: ``tls+tcp://10.0.0.5:41234/3f9c0a7b12de``. The listener proves
itself to dialers under the whole address; a dialer dials the part before the tag, so
a new process on that port refuses what was meant for the old one. A port chosen on
purpose (an agent's, which people type) names a service, and its address has no tag.
"""

from __future__ import annotations

import re
import secrets

__all__ = ["TAG_PATTERN", "dial_part", "listening_address", "tag_of"]

#: 48 random bits, in hex: how a tag is written after the port
TAG_PATTERN = r"/[0-9a-f]{12}"
_TAGGED = re.compile(rf"^((?:stream\+|tls\+)?tcp://.*:[0-9]+)({TAG_PATTERN})\Z")


def listening_address(addr: str, port: int, tag: str = "") -> str:
    """The address of a tcp listener bound at ``addr`` (its real port, no tag) when
    ``port`` was asked for: with ``tag`` when one is given (a port reserved under it),
    with a fresh tag when the kernel picked the port (``port`` 0), else ``addr``."""
    if tag or port == 0:
        return f"{addr}/{tag or secrets.token_hex(6)}"
    return addr


def dial_part(addr: str) -> str:
    """What to dial for ``addr``: its part before the tag (all of it without one)."""
    m = _TAGGED.match(addr)
    return addr if m is None else m.group(1)


def tag_of(addr: str) -> str:
    """The tag of ``addr`` (without its ``/``), or "" when it has none."""
    m = _TAGGED.match(addr)
    return "" if m is None else m.group(2)[1:]

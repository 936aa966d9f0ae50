"""A gibibyte through every adverb with default settings: no worker lost."""

from __future__ import annotations

import hashlib
import os
import resource
import sys

import anyio
import pytest

from amesh import ProcMesh

from .actors import Big

pytestmark = pytest.mark.anyio

GIB = 1 << 30
#: a pattern that a shifted or truncated copy would not match
_PATTERN = bytes(range(251))


def blob() -> bytes:
    return (_PATTERN * (GIB // len(_PATTERN) + 1))[:GIB]


def fingerprint(data: bytes) -> tuple[int, bytes, bytes]:
    return len(data), bytes(data[:: 1 << 20]), bytes(data[-100:])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # one backend: the payload path is the same, and it is slow


async def test_a_gibibyte_through_every_adverb() -> None:
    data = blob()
    want = fingerprint(data)
    with anyio.fail_after(600):
        async with ProcMesh({"procs": 2}) as procs:
            big = await procs.spawn("big", Big)
            one = big.slice(procs=0)
            pids = await big.pid.call()
            # argument and result of call_one (shared memory on one host)
            assert await one.fingerprint.call_one(data) == want
            got = await one.make.call_one(GIB)
            assert fingerprint(got) == want
            del got
            # to two ranks: written once into shared memory, which each rank reads
            assert list((await big.fingerprint.call(data)).values()) == [want, want]
            results = await big.make.call(GIB)
            assert [fingerprint(r) for r in results.values()] == [want, want]
            del results
            # broadcast: no reply; each rank keeps what it got
            await big.keep.broadcast(data)
            assert list((await big.kept.call()).values()) == [want, want]
            assert await big.pid.call() == pids  # no worker was lost or restarted
            peaks = list((await big.peak_rss_mib.call()).values())
    controller = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS MiB: controller {controller:.0f}, workers {peaks}", file=sys.stderr)


async def test_large_bytes_that_are_kept_never_change() -> None:
    """A large ``bytes`` is read into an object received before only once nobody
    holds that one: what a worker and the controller keep stays as it came."""
    sent = [os.urandom(2 << 20) for _ in range(6)]
    digests = [hashlib.sha256(b).hexdigest() for b in sent]
    with anyio.fail_after(60):
        async with ProcMesh({"procs": 1}) as procs:
            one = (await procs.spawn("big", Big)).slice(procs=0)
            for i, data in enumerate(sent):  # the worker keeps each one it gets
                assert await one.hoard.call_one(data) == digests[: i + 1]
            kept = []
            for data in sent:  # the controller keeps every other reply
                got = await one.echo.call_one(data)
                assert got == data
                if len(kept) < 3:
                    kept.append(got)
                del got  # dropped: the next reply may be read into it
            assert [hashlib.sha256(b).hexdigest() for b in kept] == digests[:3]
            assert await one.hoard.call_one(b"") == [*digests, hashlib.sha256().hexdigest()]

"""The zygote's memory, made ready for forking (:mod:`amesh._hosts._zygote_main` calls
these before it forks): the free blocks of pymalloc's partly used pools and the free
chunks of the C heap taken, the code its rehearsal ran copied together, and what it
loaded frozen out of the garbage collector's reach (immortal where Python can), so
that a worker writes to as few of the pages it shares with the zygote as it can.
Their figures are in ``bench/README.md``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
import tempfile
import types
from collections.abc import Mapping
from typing import Any

try:
    from .._native import _ext
except ImportError:  # not built (not Linux): no zygote runs anyway
    _ext = None  # type: ignore[assignment]
from .._config import settings

#: what fills the free blocks of the allocator's partly used pools (see _fill_pools)
_filler: list[object] = []
#: a line of the size-class table of ``sys._debugmallocstats()``
_POOL_LINE = re.compile(rb"^\s*\d+\s+(\d+)\s+\d+\s+\d+\s+(\d+)\s*$", re.MULTILINE)


def free_blocks() -> dict[int, int]:
    """The free blocks of the small-object allocator's partly used pools, by block
    size, as ``sys._debugmallocstats()`` writes them (to the C ``stderr``); empty where
    it writes none (another allocator)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    return {int(size): int(avail) for size, avail in _POOL_LINE.findall(text)}


def _fill_pools() -> None:
    """Take every free block of the small-object allocator's partly used pools, so
    that a child's allocations go to pools of its own (fresh pages, each written by
    many of its objects) instead of writing one block here and one there in pages it
    shares with the zygote. The counts per size class come from
    ``sys._debugmallocstats()``; the blocks are ``bytes`` (and floats and objects for
    the two smallest classes) of the size that lands in the class. A worker's page
    faults to its first answer, 256 workers: ~910 -> ~869 on 3.13, ~1,629 -> ~1,584 on
    3.11; ~0.2 MiB less memory (PSS) a worker. What it takes stays taken: the blocks
    that were free, a few hundred kB at most."""
    for size, avail in free_blocks().items():
        if size <= 16:
            _filler.extend(object() for _ in range(avail))
        elif size <= 32:
            _filler.extend(float(i) + 0.5 for i in range(avail))
        else:
            n = size - 33  # a bytes object of n bytes asks for 33 + n
            _filler.extend(bytes(n) for _ in range(avail))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


#: what fills the free chunks of the C allocator's heap (see _fill_heap): their addresses
_heap_filler: list[int] = []
#: the request sizes _fill_heap takes free chunks with: large ones first, then each of
#: the C allocator's small size classes (16 bytes apart; the per-thread caches hold up
#: to 1,032 bytes), all under the size it would map on its own (128 KiB)
_HEAP_SIZES = [1 << k for k in range(16, 10, -1)] + list(range(1016, 15, -16))


def _libc() -> Any:
    """glibc's malloc, free, sbrk and mallinfo2, or None (another C library, or a glibc
    before 2.33)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _fill_heap() -> int:
    """Take every free chunk of the C allocator's heap (glibc's ``malloc``: its bins and
    per-thread caches), as :func:`_fill_pools` does for Python's small-object
    allocator, and for the same reason: a child's ``malloc`` then carves its memory from
    the top of the heap, fresh pages each written by many of its allocations, instead of
    a chunk here and there on pages it shares with the zygote (each taken chunk writes
    its own page, and unlinking it the pages of its neighbours in the bin). Returns how
    many chunks it took (0 where the C library is not glibc).

    A size is asked for until ``malloc`` answers from the top chunk (at or above
    ``sbrk(0)`` less the top's size): no free chunk fits it any longer. What it takes
    stays taken, never written again: the free chunks there were, a few hundred kB, and
    one request a size from the top; never more than those (should the top not be
    where ``sbrk`` says, it stops there). The zygote runs one thread, so one heap."""
    libc = _libc()
    if libc is None:
        return 0
    info = libc.mallinfo2()
    # what is free in the bins, and 1 MiB for the per-thread caches (which it counts
    # as used: ~240 kB at most) and one request a size from the top (~160 kB)
    budget = info.fordblks - info.keepcost + (1 << 20)
    taken = 0
    for size in _HEAP_SIZES:
        while budget >= size:
            top = libc.sbrk(0) - libc.mallinfo2().keepcost
            address = libc.malloc(size)
            if address is None:  # out of memory: leave the rest free
                return taken
            _heap_filler.append(address)
            budget -= size
            if address >= top:
                break
            taken += 1
    return taken


def _take_free() -> None:
    """Collect, then take what the allocators hold free (:func:`_fill_pools`,
    :func:`_fill_heap`): what is allocated next lands on fresh pages."""
    gc.collect()
    _fill_pools()
    _fill_heap()


def _relocate(ran: Mapping[int, types.CodeType]) -> int:
    """Copy the code objects ``ran`` (id to code, in the order they first ran) to pages of
    their own, one after the other, and point their functions (and the code objects
    whose constants they are) at the copies. Returns how many functions now run a copy.

    A call writes the function's code object (its reference count; on 3.11 also its
    warm-up counter and specialized instructions), so a child copies the page of every
    code object it runs; as imported, those lie among all the others and the names,
    tuples and strings unmarshalled with them, a page or so each. Copied together after
    the imports (pools and heap filled first, so they land on fresh pages), the ones a
    worker runs share ~125 pages instead of ~245. Code objects compare by value: they
    are told apart here by identity."""
    _take_free()
    copies: dict[int, types.CodeType] = {}

    def copy(code: types.CodeType) -> types.CodeType:
        if (done := copies.get(id(code))) is not None:
            return done
        consts = tuple(
            copy(c) if type(c) is types.CodeType and id(c) in ran else c for c in code.co_consts
        )
        copies[id(code)] = new = code.replace(co_consts=consts)
        return new

    for code in ran.values():
        copy(code)
    moved = 0
    for f in gc.get_objects():
        if type(f) is types.FunctionType and (new := copies.get(id(f.__code__))) is not None:
            f.__code__ = new  # (the copy has the same free variables)
            moved += 1
    return moved


def _settle() -> None:
    """Make what this process has loaded last for the children it forks: keep the
    collector off it (``gc.freeze``: the children share these pages until they write
    them), and where the interpreter can (CPython 3.12 and 3.13, ``AMESH_ZYGOTE_IMMORTAL``
    on), make it immortal, so that a child's references to it write nothing either
    (PEP 683; :func:`amesh._native._ext.immortalize`). A worker's page faults from its start to
    its first answer, on 3.13 (256 workers): ~1,485 -> ~955; PSS 5.6 -> 3.5 MiB (3.11:
    ~1,650 and 6.3 MiB). Objects made immortal are never freed: what the zygote drops
    later (an environment it replaces) stays, a few kB."""
    _take_free()  # (what the children allocate goes to pages of their own)
    if _ext is not None and _ext.CAN_IMMORTALIZE:
        try:
            immortal = settings().zygote_immortal
        except Exception:  # a bad value: each child meets it again, and reports it
            immortal = False
        if immortal:
            _ext.immortalize(gc.get_objects())
    gc.freeze()

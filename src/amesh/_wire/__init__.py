"""The wire: what a message is, from the sender's objects to the frame and back.

One message object, :class:`Payload`, goes from the sender to the receiver: the sender
makes it (:func:`dumps`, or :func:`dumps_plain`/:func:`dumps_args` for builtin values)
and puts its ``inline``, ``lengths`` and ``parts`` in an envelope and its frame; the
receiver gives the envelope's ``payload`` and the frame's buffers to :func:`loads`,
whoever it is (a worker its call's arguments, a caller its replies).

Its modules, each one concern, and used only through this front door:

- ``_envelopes``: the msgspec envelopes, their checks, and frames (:func:`encode`,
  :func:`decode`, in C where the extension is built);
- ``_payload``: :class:`Payload` and :func:`loads`;
- ``_pickling``: the pickler (protocol 5, out-of-band buffers, the plain fast paths);
- ``_code``: code from ``__main__`` shipped by value, with its source lines;
- ``_tensor``: torch tensors as their raw bytes;
- ``_segments``: shared-memory segments and their life (made, pooled, loaded,
  released, discarded, swept);
- ``_processes``: which process this is, for good, and whether another one ended
  (segments and test sessions are named by their process).

The job's key and id, which the transport also uses, are a layer below
(:mod:`amesh._identity`).
"""

from __future__ import annotations

from ._envelopes import (
    INLINE_LIMIT,
    LOG,
    MAGIC,
    MAX_LINE,
    MAX_NAME,
    MAX_OUTPUT_LINES,
    MAX_TEXT,
    NO_ACTOR,
    STDERR,
    STDOUT,
    VERSION,
    BadFrame,
    BadVersion,
    Call,
    Cancel,
    Cast,
    Credit,
    Died,
    Envelope,
    Error,
    FailureReport,
    Frame,
    Gathered,
    Heartbeat,
    Output,
    OutputLine,
    Prune,
    Ready,
    Relay,
    Reply,
    addressed,
    clip,
    decode,
    encode,
    encode_envelope,
    frame_size,
    is_address,
    join,
    payload_size,
    try_decode,
)
from ._payload import (
    Payload,
    loads,
    plain_payload,
)
from ._pickling import (
    OOB_THRESHOLD,
    dumps,
    dumps_args,
    dumps_plain,
    small_tree,
)
from ._processes import (
    has_procfs,
    is_dead,
    pid_namespace,
    this_process,
)
from ._segments import (
    discard_segments,
    for_receivers,
    release_payload,
    release_segments,
    remove_segments_of,
    segment_prefix,
    shm_dir,
    shm_threshold,
    sweep_segments,
)

__all__ = [
    "INLINE_LIMIT",
    "LOG",
    "MAGIC",
    "MAX_LINE",
    "MAX_NAME",
    "MAX_OUTPUT_LINES",
    "MAX_TEXT",
    "NO_ACTOR",
    "OOB_THRESHOLD",
    "STDERR",
    "STDOUT",
    "VERSION",
    "BadFrame",
    "BadVersion",
    "Call",
    "Cancel",
    "Cast",
    "Credit",
    "Died",
    "Envelope",
    "Error",
    "FailureReport",
    "Frame",
    "Gathered",
    "Heartbeat",
    "Output",
    "OutputLine",
    "Payload",
    "Prune",
    "Ready",
    "Relay",
    "Reply",
    "addressed",
    "clip",
    "decode",
    "discard_segments",
    "dumps",
    "dumps_args",
    "dumps_plain",
    "encode",
    "encode_envelope",
    "for_receivers",
    "frame_size",
    "has_procfs",
    "is_address",
    "is_dead",
    "join",
    "loads",
    "payload_size",
    "pid_namespace",
    "plain_payload",
    "release_payload",
    "release_segments",
    "remove_segments_of",
    "segment_prefix",
    "shm_dir",
    "shm_threshold",
    "small_tree",
    "sweep_segments",
    "this_process",
    "try_decode",
]

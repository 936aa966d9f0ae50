"""amesh's C extension, :mod:`._ext` (built from ``ext/``, typed by ``_ext.pyi``): the
stream reader and writer, the envelope codec, the NNG bridge, the heartbeat thread and
the process helpers. It imports no Python module of amesh; its own package makes it a
node of the import graph like any other (``from .._native import _ext``), the lowest
layer of the contract in ``pyproject.toml``. Importing this package loads nothing."""

"""What a long start is doing now, told to whoever listens: the server shows it in its log and in /health's body.
More: docs/internals.md."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, int | None, int | None], None]  # (what, done, total): done of total steps, when counted

_local = threading.local()


def report(what: str, done: int | None = None, total: int | None = None) -> None:
    """Now doing `what` (e.g. "dequantising target.gguf"), `done` of its `total` steps when they are counted."""
    for listener in getattr(_local, "listeners", ()):
        listener(what, done, total)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Tell `listener` of every report made on this thread until the block ends."""
    listeners = _local.__dict__.setdefault("listeners", [])
    listeners.append(listener)
    try:
        yield
    finally:
        listeners.remove(listener)


def name_of(path: str | os.PathLike[str]) -> str:
    """A model as reports name it: its file's name."""
    return os.path.basename(os.fspath(path)) or "the model"

"""A bounded cache that several threads may read and fill at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


class BoundedCache:
    """Values by key, at most ``maxsize`` of them (the oldest goes first), safe from several threads.

    A value is built outside the lock (building may trace or compile, and may use the cache
    again); when two threads build the same key at once, the first value stored is the one both
    get, so every caller of a key sees one value.

    Args:
      maxsize: values kept.
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: dict = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any], keep: Callable[[Any], bool] = lambda value: True) -> Any:
        """The value for ``key``; on a miss ``build()``'s, stored when ``keep(value)``."""
        with self._lock:
            if key in self._entries:
                return self._entries[key]
        value = build()
        if not keep(value):
            return value
        with self._lock:
            if key in self._entries:
                return self._entries[key]
            if len(self._entries) >= self.maxsize:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = value
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Drop every value."""
        with self._lock:
            self._entries.clear()

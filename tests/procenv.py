"""Environment variables set for a block: what a process started inside it inherits."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environ(env: dict[str, str] | None) -> Iterator[None]:
    """`os.environ` with `env` added inside the block, as it was after."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value

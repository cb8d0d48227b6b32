"""Shared test helpers: run a scenario in a fresh process, so memory readings are its own."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest


def run_isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` in a new spawned Python process and return its result."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture
def isolated() -> Callable[..., Any]:
    return run_isolated

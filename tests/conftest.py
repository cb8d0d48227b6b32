"""Shared test helpers: run a scenario in a fresh process, so memory readings are its own."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from procenv import environ

try:  # the GPU machine runs tests/gpu in plain processes, without Monarch
    import monarch  # noqa: F401

    pytest_plugins = ["colocate.testing"]
except ImportError:
    pytest_plugins = []


def run_isolated(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """Run `fn(*args)` in a new spawned Python process (with `env` added to its
    environment) and return its result."""
    with environ(env):
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        future = pool.submit(fn, *args)  # the worker starts here, with `env`
    with pool:
        return future.result()


@pytest.fixture
def isolated() -> Callable[..., Any]:
    return run_isolated


# tiny random Hugging Face models, one per architecture the tests cover (Qwen2 with tied
# embeddings), written once per session
MODELS = {"llama": {}, "qwen2": {"tie_embeddings": True}, "qwen3": {}}
ALPHABET = "0123456789+=>"


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """architecture -> the directory of a tiny random model of it (seed 0)."""
    from colocate.engines.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(write_tiny_model(root / arch, arch, alphabet=ALPHABET,
                                       max_positions=48, **options))
            for arch, options in MODELS.items()}


@pytest.fixture(scope="module")
def procs_import_tests() -> Iterator[None]:
    """Procs unpickle actors and functions defined in test modules (`test_x.Probe`): put
    this directory on the PYTHONPATH that the procs (started after this) inherit."""
    saved = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved

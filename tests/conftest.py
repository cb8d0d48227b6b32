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

    pytest_plugins = ["colocate.testing", "slurm_cluster"]
except ImportError:
    pytest_plugins = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failure's report even when Python 3.11.7 cannot parse its source for pytest: the
    AST constructor's depth counter is shared by threads (CPython gh-106905, fixed in
    3.11.8), and its `SystemError` while pytest formats a failure ended the whole session
    (INTERNALERROR, no later test run). Then the failure is told without source lines."""
    try:
        return (yield)
    except SystemError as err:
        if "recursion depth mismatch" not in str(err) or call.excinfo is None:
            raise
        lines = [f"{entry.path}:{entry.lineno + 1}: in {entry.name}"
                 for entry in call.excinfo.traceback]
        lines += [call.excinfo.exconly(), f"(source not shown: {err}, CPython gh-106905)"]
        return pytest.TestReport(
            item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed",
            "\n".join(lines), call.when, duration=call.duration, start=call.start,
            stop=call.stop, user_properties=item.user_properties)


# The files to run first: long ones (`--durations=0` of a quiet 2-core run), `make test`'s
# two workers taking whole files in collection order, so that a long file is not left to
# the end to run alone while the other worker idles. This order ran fastest of the three
# tried (bench/RESULTS.md, "A proc's start").
LONGEST_FIRST = ("test_slurm_loop.py", "test_gpu_bundle.py", "test_vllm_engine.py",
                 "test_switch_faults.py", "test_properties.py", "test_memory.py",
                 "test_notebook.py", "test_vllm_procs.py", "test_vllm_replicas.py",
                 "test_chaos.py", "test_step_budget.py", "test_partial.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the files of `LONGEST_FIRST` first, in that order (the rest as collected)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


@pytest.fixture(scope="session")
def vllm_preloaded() -> None:
    """Procs forked from now on (by this process's fork server) start with vLLM's engine
    modules imported, as a run with run.engine=vllm has them (`zygote.preload`)."""
    from colocate.engines.actors import ENGINE_MODULES
    from colocate.resources import zygote

    zygote.preload(*ENGINE_MODULES["vllm"])


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

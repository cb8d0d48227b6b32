"""Functions named by a spec, `module:function` or `path/to/file.py:function`, loaded in
whatever process needs them: the RL loop's reward functions, a tool service's tools.

A spec is text, so it crosses process boundaries where a function defined in a user's file
could not be pickled: each process loads the function itself. A file is loaded as a module
of its own, under a name made from its path (two files may share a stem), and registered in
`sys.modules` so that the dataclasses and pickles it makes find it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_function(spec: str, setting: str, error: type[Exception] = ValueError
                  ) -> Callable[..., Any]:
    """The function `spec` names: `module:function` (a module importable from here) or
    `path/to/file.py:function` (a file anywhere, loaded as a module of its own). A spec that
    names nothing callable raises `error` with one line naming `setting` (the config field
    that gave it: "reward.funcs"), the spec and what is wrong."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise error(f"{setting}: {spec!r}: write module:function or path/to/file.py:function")
    path = None
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise error(f"{setting}: {spec}: no such file {module_name}")
    try:
        module = _load_file(path) if path is not None else importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise error(f"{setting}: {spec}: no module {err.name!r} on the path; give a module "
                    "importable from where the run starts, or the path of its .py "
                    "file") from None
    except Exception as err:
        raise error(f"{setting}: {spec}: importing {module_name} failed: "
                    f"{type(err).__name__}: {err}") from err
    fn = getattr(module, name, None)
    if fn is None:
        raise error(f"{setting}: {spec}: {module_name} has no {name!r}")
    if not callable(fn):
        raise error(f"{setting}: {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _load_file(path: Path) -> Any:
    """The module of a .py file, loaded once per process."""
    unique = f"_spec_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    module = sys.modules.get(unique)
    if module is None:
        loader = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[unique] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[unique]  # a fixed file loads anew
            raise
    return module

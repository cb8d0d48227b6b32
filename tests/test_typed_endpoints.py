"""`svc.<endpoint>`: typed from the actor class's endpoint (mypy with services.mypy_plugin),
and at run time route/fanout only, with a method that is not an endpoint told from a typo."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from monarch.actor import Actor, endpoint

from services.endpoint import ACTOR_VERBS, ServiceEndpoint, endpoint_error

ROOT = Path(__file__).resolve().parent.parent


class Gen(Actor):
    @endpoint
    async def generate(self, prompt: str, n: int = 1) -> list[str]:
        return [prompt] * n

    def helper(self) -> None:
        pass


def test_a_method_that_is_not_an_endpoint_is_told_from_a_typo():
    endpoints = {"generate"}
    plain = endpoint_error("gen", Gen, endpoints, "helper")
    assert "Gen.helper is a method, not an @endpoint" in str(plain)
    typo = endpoint_error("gen", Gen, endpoints, "generat")
    assert "has no endpoint 'generat'; did you mean 'generate'?" in str(typo)
    assert "did you mean" not in str(endpoint_error("gen", Gen, endpoints, "zzz"))
    assert "its endpoints: generate" in str(endpoint_error("gen", Gen, endpoints, "zzz"))


def test_actor_verbs_say_to_route_or_fanout_and_route_takes_only_the_endpoints_arguments():
    sent = []

    async def route(name, args, kwargs):
        sent.append(("route", name, args, kwargs))
        return "one"

    async def fanout(name, args, kwargs):
        sent.append(("fanout", name, args, kwargs))
        return ["one", "two"]

    ep: ServiceEndpoint = ServiceEndpoint("gen", "generate", route, fanout)
    for verb in ACTOR_VERBS:
        with pytest.raises(AttributeError, match=rf"generate\.{verb}\(\) is an actor verb; a "
                                                 r"service supports route\(\).*fanout\(\)"):
            getattr(ep, verb)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        ep.nope  # noqa: B018
    assert asyncio.run(ep.route("hi", n=2)) == "one"
    assert asyncio.run(ep.route("hi", session="s")) == "one"  # the endpoint's, if it has one
    assert asyncio.run(ep.fanout("hi")) == ["one", "two"]
    assert sent == [("route", "generate", ("hi",), {"n": 2}),
                    ("route", "generate", ("hi",), {"session": "s"}),
                    ("fanout", "generate", ("hi",), {})]


USER_SCRIPT = '''
from monarch.actor import Actor, endpoint

from services import ServiceConfig, spawn_service


class Gen(Actor):
    @endpoint
    async def generate(self, prompt: str, n: int = 1) -> list[str]:
        return [prompt] * n


async def main() -> None:
    svc = await spawn_service(ServiceConfig(), Gen)
    async with svc.session():
        texts: list[str] = await svc.generate.route("hi", n=2)  # right
    await svc.generate.fanout(3)  # wrong
    await svc.generate.route("hi", session="s")  # wrong: a session is a block
'''

MYPY_CONFIG = """
[mypy]
plugins = services.mypy_plugin
ignore_missing_imports = True
follow_imports = skip
[mypy-services,services.*]
follow_imports = silent
"""


def test_the_type_checker_reports_exactly_the_wrong_calls(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed: it is in the dev extras "
                                       "(pip install -e '.[dev]')")
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    env = {**os.environ, "MYPYPATH": str(ROOT),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", str(script)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    lines = textwrap.dedent(USER_SCRIPT).splitlines()
    wrong = 1 + lines.index("    await svc.generate.fanout(3)  # wrong")
    session = 1 + lines.index("    await svc.generate.route(\"hi\", session=\"s\")  # wrong: a "
                              "session is a block")
    assert len(errors) == 2, done.stdout + done.stderr
    assert re.search(rf"user\.py:{wrong}: error: Argument 1 to \"fanout\" of "
                     r"\"ServiceEndpoint\" has incompatible type \"int\"; expected \"str\"",
                     errors[0]), errors
    assert re.search(rf"user\.py:{session}: error: Unexpected keyword argument \"session\" "
                     r"for \"route\"", errors[1]), errors

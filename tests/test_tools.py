"""Tools as users write them, in-process: loading by spec with their JSON schemas (and every
bad spec refused in one line), a call's outcomes as observations, the tool-call forms and
their bad calls, environments, the config sections, and the multiply task's files."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from colocate.engines.tools import ToolSpecError, as_text, call_tool, load_tools
from examples.rl_loop.config import load_config
from examples.rl_loop.envs import EnvError, load_env, reset_env, step_env
from examples.rl_loop.tasks import multiply, multiply_reward, multiply_tools
from examples.rl_loop.tool_calls import (
    ParsedTurn,
    ToolCall,
    observations,
    parse_hermes,
    parse_plain,
    parse_template,
    parse_turn,
    plain_alphabet,
    render_plain,
)

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = f"{ROOT}/examples/rl_loop/tasks/multiply_tools.py:calculator"

TOOLS = '''
import asyncio, time

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b

async def shout(text: str) -> dict:
    """Shout.

    Args:
        text: what to shout
    """
    return {"said": text.upper()}

def fails(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise ZeroDivisionError("on purpose")

def sleeps(seconds: float) -> str:
    """Sleep on this thread.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "slept"

async def naps(seconds: float) -> str:
    """Sleep in the event loop.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "napped"

def opaque(x: int) -> str:
    """Return something that is not text.

    Args:
        x: anything
    """
    return object()

def no_doc(x: int) -> str:
    return ""

def no_hints(x):
    """No hints.

    Args:
        x: anything
    """

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return path


# ---- loading ----

def test_tools_load_by_spec_with_their_json_schemas(tools_file):
    tools = load_tools([f"{tools_file}:add", f"{tools_file}:shout", CALCULATOR])
    assert list(tools) == ["add", "shout", "calculator"]
    assert tools["calculator"].schema == get_json_schema(multiply_tools.calculator)
    assert tools["add"].schema["function"]["parameters"]["required"] == ["a", "b"]
    assert tools["shout"].is_async and not tools["add"].is_async
    module = load_tools(["examples.rl_loop.tasks.multiply_tools:calculator"])
    assert module["calculator"].schema == tools["calculator"].schema  # a module's, the same


def test_bad_tool_specs_are_refused_in_one_line(tools_file, tmp_path):
    cases = {
        f"{tmp_path}/missing.py:f": r"tools.funcs: .*missing.py:f: no such file",
        f"{tools_file}:nope": r"my_tools.py has no 'nope'",
        f"{tools_file}:NOT_A_FUNCTION": r"NOT_A_FUNCTION is a int, not a function",
        f"{tools_file}:no_doc": r"no_doc: no JSON schema .* has no docstring.*Args: line",
        f"{tools_file}:no_hints": r"no_hints: no JSON schema .*missing a type hint",
        "no_such_module_xyz:f": r"no module 'no_such_module_xyz' on the path",
        "nocolon": r"'nocolon': write module:function",
    }
    for spec, match in cases.items():
        with pytest.raises(ToolSpecError, match=match) as refused:
            load_tools([spec])
        assert "\n" not in str(refused.value), spec
    with pytest.raises(ToolSpecError, match="a second tool named 'add'"):
        load_tools([f"{tools_file}:add", f"{tools_file}:add"])


# ---- a call's outcomes ----

def test_every_outcome_of_a_call_is_an_observation(tools_file):
    tools = load_tools([f"{tools_file}:{name}" for name in
                        ("add", "shout", "fails", "sleeps", "naps", "opaque")])

    async def call(name: str, arguments, timeout_s: float = 5.0):
        return await call_tool(tools.get(name), name, arguments, timeout_s)

    async def all_calls():
        return [await call("add", {"a": 2, "b": 3}),
                await call("add", '{"a": 2, "b": 3}'),  # JSON text, as models write it
                await call("shout", {"text": "hi"}),
                await call("fails", {"x": 1}),
                await call("opaque", {"x": 1}),
                await call("nope", {}),
                await call("add", {"a": 1}),
                await call("add", "{not json"),
                await call("add", "[1, 2]")]

    got = asyncio.run(all_calls())
    assert [(r.content, r.error) for r in got[:3]] == [("5", None), ("5", None),
                                                        ('{"said": "HI"}', None)]
    assert got[3].error == "raised" and "ZeroDivisionError: on purpose" in got[3].content
    assert got[4].error == "not_text" and "returned a object" in got[4].content
    assert got[5].error == "unknown_tool" and "no tool named 'nope'" in got[5].content
    assert [r.error for r in got[6:]] == ["bad_arguments"] * 3
    assert "missing a required argument: 'b'" in got[6].content
    assert "not JSON" in got[7].content and "a list, not an object" in got[8].content
    for name in ("sleeps", "naps"):  # a sync tool on its thread, an async one: both bounded
        start = time.monotonic()
        late = asyncio.run(call(name, {"seconds": 3}, timeout_s=0.3))
        assert late.error == "timeout" and "within 0.3 s" in late.content
        assert time.monotonic() - start < 2
    assert as_text([1, "a"]) == '[1, "a"]' and as_text({1, 2}) is None


def test_a_sync_tool_counts_as_running_until_it_returns_and_no_longer(tools_file):
    """What a worker reports as stuck: a tool past its limit, never one that has returned
    and whose thread is still winding down (a busy machine can keep that thread alive)."""
    tools = load_tools([f"{tools_file}:{name}" for name in ("add", "sleeps")])
    running: set = set()

    async def calls():
        done = await call_tool(tools["add"], "add", {"a": 1, "b": 1}, 5.0, running)
        assert (done.content, running) == ("2", set())
        late = await call_tool(tools["sleeps"], "sleeps", {"seconds": 1.0}, 0.1, running)
        assert late.error == "timeout" and len(running) == 1
        await asyncio.sleep(2.0)
        assert running == set()

    asyncio.run(calls())


# ---- the calculator and the multiply task ----

def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    calc = multiply_tools.calculator
    assert calc("123*456") == "56088" and calc(" (2+3)*4 - 1 ") == "19"
    assert calc("7/2") == "3.5" and calc("2**10") == "1024" and calc("-7//2") == "-4"
    for bad, match in [("__import__('os').system('true')", "not arithmetic"),
                       ("x*2", "not arithmetic"), ("2**1000", "exponents up to 64"),
                       ("9**64*9**64", "over 100 digits"), ("1/0", "division by zero"),
                       ("1+", "not an arithmetic expression"), ("1" * 300, "over 200")]:
        with pytest.raises((ValueError, ZeroDivisionError), match=match):
            calc(bad)


def test_the_multiply_task_holds_out_its_eval_and_scores_the_final_answer(tmp_path):
    train, held = multiply.write(tmp_path, train_size=300, eval_size=20, seed=1)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()]
            for name, path in (("train", train), ("eval", held))}
    assert (len(rows["train"]), len(rows["eval"])) == (300, 20)
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["eval"]}
    for row in rows["train"] + rows["eval"]:
        a, b = row["prompt"].removesuffix("=").split("*")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert row["answer"] == multiply_tools.calculator(f"{a}*{b}")
    chat = [{"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "56088"},
            {"role": "assistant", "content": "56088"}]
    completions = [chat, "calc(123*456)[56088]56088", "calc(123*456)[56088]56000", "56088",
                   [{"role": "assistant", "content": '<tool_call>{"name": "c"}</tool_call>'}]]
    assert multiply_reward.correct(completions, ["56088"] * 5) == [1.0, 1.0, 0.6, 1.0, 0.0]


def test_a_plain_transcript_is_in_the_character_models_vocabulary(tmp_path):
    """The multiply task's characters and the plain form's: the tiny model built over
    them reads and writes a whole tool-using transcript."""
    from colocate.engines.models import load_tokenizer
    from colocate.engines.tiny import write_tiny_model
    from examples.rl_loop.data import characters, read_rows

    files = [str(p) for p in multiply.write(tmp_path / "data", train_size=50, eval_size=5)]
    alphabet = "".join(sorted(set(characters(read_rows(files, "data.train_files", "prompt")))
                              | set(plain_alphabet(["calc"]))))
    tokenizer = load_tokenizer(str(write_tiny_model(tmp_path / "m", "llama",
                                                    alphabet=alphabet)))
    transcript = "123*456=calc(123*456)" + render_plain("56088", None) + "56088"
    tokens = tokenizer(transcript, add_special_tokens=False).input_ids
    assert len(tokens) == len(transcript) and tokenizer.decode(tokens) == transcript
    assert tokenizer.unk_token_id not in tokens


# ---- tool-call forms ----

def test_hermes_calls_are_parsed_and_bad_ones_told_apart():
    text = ('Let me see.<tool_call>{"name": "calculator", "arguments": {"expression": '
            '"1+2"}}</tool_call><tool_call>{"name": "calculator", "arguments": '
            '"{\\"expression\\": \\"3\\"}"}</tool_call>')
    turn = parse_hermes(text)
    assert turn.content == "Let me see." and not turn.bad
    assert turn.calls == [ToolCall("calculator", {"expression": "1+2"}),
                          ToolCall("calculator", {"expression": "3"})]
    assert turn.as_message()["tool_calls"][0] == {
        "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    bad = {'<tool_call>{"name": "calc", "arguments": {bad}}</tool_call>': "not JSON",
           '<tool_call>{"arguments": {}}</tool_call>': "no tool name",
           '<tool_call>{"name": "c", "arguments": [1]}</tool_call>': "a list, not an object",
           '<tool_call>{"name": "c", "arguments": "{x"}</tool_call>': "arguments of c are not",
           '<tool_call>{"name": "c", "arguments": {}}': "never closed",
           '<tool_call>[1]</tool_call>': "expected an object"}
    for written, why in bad.items():
        turn = parse_hermes("ok " + written)
        assert turn.calls == [] and len(turn.bad) == 1 and turn.has_calls, written
        assert why in turn.bad[0].why and turn.content == "ok"
        assert turn.bad[0].observation()["content"].startswith("bad call: ")
    assert parse_hermes("no call here") == ParsedTurn("no call here")
    mixed = parse_hermes(text + '<tool_call>{"arguments": {}}</tool_call>')
    assert observations(mixed, ["3", "3"]) == [
        {"role": "tool", "name": "calculator", "content": "3"},
        {"role": "tool", "name": "calculator", "content": "3"},
        {"role": "tool", "content": 'bad call: no tool name ("name": ...)'}]
    with pytest.raises(ValueError, match="1 result.* for 2 call"):
        observations(mixed, ["3"])


def test_plain_calls_for_the_character_model():
    schemas = [t.schema for t in load_tools([CALCULATOR]).values()]
    turn = parse_plain("calc(123*456)", schemas)
    assert turn.calls == [ToolCall("calculator", {"expression": "123*456"})]
    assert parse_plain("calculator(1+1)", schemas).calls[0].arguments == {"expression": "1+1"}
    assert parse_plain("56088", schemas) == ParsedTurn("56088")
    assert "no tool named sqrt" in parse_plain("sqrt(4)", schemas).bad[0].why
    assert "never closed" in parse_plain("calc(12*3", schemas).bad[0].why
    assert render_plain("56088", None) == "[56088]" and render_plain("x", "raised") == "[!]"
    assert set(plain_alphabet(["calc"])) == set("calc()[]!")
    assert parse_turn("calc(1*2)", "plain", schemas).calls[0].name == "calculator"
    with pytest.raises(ValueError, match="tool call form 'xml'"):
        parse_turn("", "xml")


def test_the_tokenizers_own_response_template_parses_calls(tmp_path):
    from colocate.engines.models import load_tokenizer
    from colocate.engines.tiny import write_tiny_model

    tokenizer = load_tokenizer(str(write_tiny_model(tmp_path / "m", "llama",
                                                    alphabet="0123456789")))
    text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert parse_turn(text, "template", tokenizer=tokenizer).calls  # none: Hermes instead
    tokenizer.response_template = {
        "start_anchor": "<|im_start|>assistant\n", "defaults": {"role": "assistant"},
        "fields": {"content": {},
                   "tool_calls": {"open": "<tool_call>", "close": "</tool_call>",
                                  "content": "json", "repeats": True,
                                  "transform": {"type": "function", "function": "{content}"}}}}
    schema = get_json_schema(_add)
    turn = parse_template(tokenizer, "Sum." + text, "<|im_start|>assistant\n", [schema])
    assert turn.content == "Sum." and turn.calls == [ToolCall("add", {"a": 2, "b": 3})]
    broken = parse_template(tokenizer, '<tool_call>{"name": "x"</tool_call>', "", [schema])
    assert broken.calls == [] and "could not parse" in broken.bad[0].why


def _add(a: int, b: int) -> int:
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b


# ---- environments and the config ----

ENV = '''
class Counter:
    def __init__(self):
        self.turns = 0
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]
    async def step(self, message):
        self.turns += 1
        return [{"role": "user", "content": str(self.turns)}], self.turns == 2

class Broken:
    def reset(self, row):
        return "not messages"
    def step(self, message):
        return [], "no"

class NeedsArgs:
    def __init__(self, size):
        pass
    def reset(self, row): return []
    def step(self, message): return [], True

class NoStep:
    def reset(self, row): return []

def function():
    pass
'''


def test_an_environment_is_loaded_checked_and_stepped(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV)
    env = load_env(f"{path}:Counter")()
    assert asyncio.run(reset_env(env, {"prompt": "hi"})) == [{"role": "user", "content": "hi"}]
    said = {"role": "assistant", "content": "x"}
    assert asyncio.run(step_env(env, said)) == ([{"role": "user", "content": "1"}], False)
    assert asyncio.run(step_env(env, said))[1] is True
    for name, match in [("NeedsArgs", r"NeedsArgs\(\) must take no arguments"),
                        ("NoStep", "has no step method"), ("function", "not a class"),
                        ("Missing", "has no 'Missing'")]:
        with pytest.raises(EnvError, match=f"env.cls: .*{match}"):
            load_env(f"{path}:{name}")
    broken = load_env(f"{path}:Broken")()
    with pytest.raises(EnvError, match="Broken.reset returned 'not messages': expected a list"):
        asyncio.run(reset_env(broken, {}))
    with pytest.raises(EnvError, match=r"Broken.step returned \(\[\], 'no'\): expected a tuple"):
        asyncio.run(step_env(broken, said))


def test_the_tools_and_env_sections_are_config_fields():
    task = ["data.train_files=t.jsonl", "data.eval_files=e.jsonl", "reward.funcs=[m:f]",
            "grpo.max_completion_length=8"]
    cfg = load_config(overrides=[*task, f"tools.funcs={CALCULATOR}", "tools.timeout_s=2.5",
                                 "tools.workers=2", "rollout.bad_call_reward=-1",
                                 "rollout.max_turns=3"])
    assert (cfg.tools.funcs, cfg.tools.timeout_s, cfg.tools.workers) == ([CALCULATOR], 2.5, 2)
    assert cfg.rollout.bad_call_reward == -1 and cfg.rollout.max_turns == 3
    assert load_config().tools.funcs == [] and load_config().env.cls is None
    # what the loop cannot run is refused, naming what to do instead
    with pytest.raises(ValueError, match="tools.funcs needs data.train_files"):
        load_config(overrides=[f"tools.funcs={CALCULATOR}"])
    # episodes that span steps (tests/test_partial_tools.py)
    assert load_config(overrides=[f"tools.funcs={CALCULATOR}", *task,
                                  "rollout.mode=partial"]).rollout.partial
    for override, match in [("tools.workers=0", "tools.workers=0: must be >= 1"),
                            ("tools.timeout_s=0", "tools.timeout_s=0.0: must be a number > 0"),
                            ("tools.funcs=nocolon", "write module:function"),
                            ("env.cls=nocolon", "env.cls: 'nocolon': write module:Class")]:
        with pytest.raises(ValueError, match=match):
            load_config(overrides=[override])

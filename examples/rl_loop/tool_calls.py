"""Tool calls in a model's turn: found, parsed, and the badly written ones told apart.

Three forms:

- **hermes** (Qwen2.5/Qwen3, Hermes, most chat templates that render `tools`):
  `<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>`, any
  number in a turn. `arguments` may also be a JSON string of the object.
- **template**: the tokenizer's own `response_template` through transformers'
  `tokenizer.parse_response` (with the prompt as `prefix`, the tools' schemas to cast the
  arguments), where the tokenizer defines one.
- **plain**, for the tiny character-level model, whose vocabulary is its task's characters:
  `calc(123*456)`: a tool's name, or a prefix of it that names one tool, and its one
  argument as text. `plain_alphabet` gives the characters a run must add to the model's
  vocabulary, and `render_plain` the observation's text (the result between brackets,
  `[56088]`; an error as `[!]`), so the transcript stays in that vocabulary.

A call written badly (not JSON, no name, arguments that are not an object, a `<tool_call>`
never closed, a plain call naming no tool) is a `BadCall`, never an exception: its
`observation()` tells the model what was wrong, and the rollout may score the trajectory
with `rollout.bad_call_reward`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "template", "plain")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_PLAIN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\(([^()]*)(\)?)")
PLAIN_ERROR = "!"  # the observation of a failed call, in the plain form


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """As chat templates and transformers' parser write a call in a message."""
        return {"type": "function", "function": {"name": self.name,
                                                 "arguments": self.arguments}}


@dataclass(frozen=True)
class BadCall:
    text: str  # the call as the model wrote it
    why: str

    def observation(self) -> dict[str, Any]:
        """The tool message that tells the model its call was not understood."""
        return {"role": "tool", "content": f"bad call: {self.why}"}


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: its text outside the calls, its calls in order, and the bad ones."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    bad: list[BadCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the turn asked for tools (well or badly): the trajectory goes on."""
        return bool(self.calls or self.bad)

    def as_message(self) -> dict[str, Any]:
        """The assistant message of the turn, its calls as `tool_calls`."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [call.as_dict() for call in self.calls]
        return message


def observations(turn: ParsedTurn, contents: Sequence[str]) -> list[dict[str, Any]]:
    """The tool messages after `turn`: one per call with its result's text (`contents`, in
    the calls' order), then one per bad call telling what was wrong (chat templates render
    them after the assistant message that made the calls)."""
    if len(contents) != len(turn.calls):
        raise ValueError(f"{len(contents)} result(s) for {len(turn.calls)} call(s)")
    return [{"role": "tool", "name": call.name, "content": content}
            for call, content in zip(turn.calls, contents, strict=True)] + [
        bad.observation() for bad in turn.bad]


def parse_hermes(text: str) -> ParsedTurn:
    """The Hermes form's calls in `text` (see module)."""
    calls: list[ToolCall] = []
    bad: list[BadCall] = []
    for match in _HERMES.finditer(text):
        body, closed = match.group(1), match.group(0).endswith(CLOSE)
        if not closed:
            bad.append(BadCall(match.group(0), f"{OPEN} is never closed by {CLOSE}"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            bad.append(BadCall(match.group(0), f"not JSON ({err})"))
            continue
        got = _call(data)
        (calls if isinstance(got, ToolCall) else bad).append(
            got if isinstance(got, ToolCall) else BadCall(match.group(0), got))
    return ParsedTurn(_HERMES.sub("", text).strip(), calls, bad)


def _call(data: Any) -> ToolCall | str:
    """A call from its parsed JSON: `{"name", "arguments"}`, or the same under "function"
    (OpenAI's form); what is wrong (a str) otherwise."""
    if isinstance(data, dict) and isinstance(data.get("function"), dict):
        data = data["function"]
    if not isinstance(data, dict):
        return f"expected an object with name and arguments, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return "no tool name (\"name\": ...)"
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return f"the arguments of {name} are not JSON ({err})"
    if not isinstance(arguments, dict):
        return f"the arguments of {name} are a {type(arguments).__name__}, not an object"
    return ToolCall(name, arguments)


def parse_template(tokenizer: Any, text: str, prefix: str,
                   tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
    """The calls in `text` by the tokenizer's `response_template` (transformers'
    `parse_response`; `prefix`: the prompt the turn followed). A turn the template cannot
    parse is one bad call; a call in it without a name or an object of arguments, too."""
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=list(tools or []))
    except Exception as err:  # transformers' parser: whatever it raises is a bad turn
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return ParsedTurn(text.strip(), [], [BadCall(text, first)])
    calls: list[ToolCall] = []
    bad: list[BadCall] = []
    for raw in message.get("tool_calls") or []:
        got = _call(raw)
        (calls if isinstance(got, ToolCall) else bad).append(
            got if isinstance(got, ToolCall) else BadCall(json.dumps(raw, default=str), got))
    content = message.get("content")
    return ParsedTurn(content.strip() if isinstance(content, str) else "", calls, bad)


def parse_plain(text: str, schemas: Sequence[dict[str, Any]]) -> ParsedTurn:
    """The plain form's calls in `text` (see module): `name(argument)`, where `name` is a
    tool's name or a prefix naming one tool, and the argument goes to its first
    parameter."""
    params = {s["function"]["name"]: list(s["function"]["parameters"]["properties"])
              for s in schemas}
    calls: list[ToolCall] = []
    bad: list[BadCall] = []
    for match in _PLAIN.finditer(text):
        written, argument, closed = match.groups()
        named = _named(written, params)
        if isinstance(named, BadCall):
            bad.append(BadCall(match.group(0), named.why))
        elif not closed:
            bad.append(BadCall(match.group(0), f"{written}( is never closed by )"))
        elif not params[named]:
            calls.append(ToolCall(named, {}))
        else:
            calls.append(ToolCall(named, {params[named][0]: argument}))
    return ParsedTurn(_PLAIN.sub("", text).strip(), calls, bad)


def _named(written: str, params: dict[str, list[str]]) -> str | BadCall:
    if written in params:
        return written
    found = [name for name in params if name.startswith(written)]
    if len(found) == 1:
        return found[0]
    why = (f"{written} names {len(found)} tools ({', '.join(sorted(found))})" if found
           else f"no tool named {written}; tools: {', '.join(sorted(params))}")
    return BadCall(written, why)


def parse_turn(text: str, form: str, schemas: Sequence[dict[str, Any]] = (),
               tokenizer: Any = None, prefix: str = "") -> ParsedTurn:
    """The calls in a turn in `form` (one of FORMATS); "template" needs the tokenizer, and
    falls back to "hermes" for a tokenizer without a response_template."""
    if form not in FORMATS:
        raise ValueError(f"tool call form {form!r}: use one of {FORMATS}")
    if form == "plain":
        return parse_plain(text, schemas)
    if form == "template" and has_template(tokenizer):
        return parse_template(tokenizer, text, prefix, schemas)
    return parse_hermes(text)


def has_template(tokenizer: Any) -> bool:
    """Whether transformers can parse this tokenizer's responses itself."""
    return getattr(tokenizer, "response_template", None) is not None and hasattr(
        tokenizer, "parse_response")


def render_plain(content: str, error: str | None) -> str:
    """A tool's observation in the plain form: `[content]`, or `[!]` for a failed call."""
    return f"[{PLAIN_ERROR if error is not None else content}]"


def plain_alphabet(names: Collection[str]) -> str:
    """The characters the plain form adds to a character model's vocabulary: the tools'
    names (or the prefixes the model will write), the brackets and the error mark."""
    return "".join(sorted(set("".join(names)) | set("()[]" + PLAIN_ERROR)))

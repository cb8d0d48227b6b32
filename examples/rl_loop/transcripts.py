"""An episode's transcript: the tokens and messages of one multi-turn sample after its
prompt (`Episode`), and how a turn's text becomes tool calls and their results (or an
environment's messages) become the tokens the model reads next (`Transcript`: the plain
form of a tokenizer without a chat template; `ChatTranscript`: the chat template's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colocate.engines.sampling import Completion
from examples.rl_loop.data import Row
from examples.rl_loop.envs import EpisodeEnv, Message, contents
from examples.rl_loop.tool_calls import (
    ParsedTurn,
    observations,
    parse_hermes,
    parse_plain,
    parse_template,
    render_plain,
)


@dataclass
class Episode:
    """One sample's conversation after its prompt: the tokens, whether the model wrote
    each (and its log-probability there), the messages, and what happened."""

    row: Row
    session: str  # its id: its turns go to the replica that holds its KV prefix
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # for the reward functions
    said: list[dict[str, Any]] = field(default_factory=list)  # as the template renders them
    turns: int = 0
    calls: int = 0
    bad_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    computed: int = 0  # tokens whose keys and values a turn computed, from the prompt's start
    ended: str = ""  # answer (its stop token), length, max_turns, overflow; done, env_error
    env: EpisodeEnv | None = None  # env.cls: its own instance

    def add(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """Tokens the model wrote (with their log-probabilities) or an observation's."""
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.trained += [logprobs is not None] * len(tokens)

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs),
                          stopped=self.ended in ("answer", "done"), finished=True)


class Transcript:
    """How a turn's text becomes tool calls and their results (or an environment's
    messages) become the tokens the model reads next: the plain form, for a tokenizer
    without a chat template (the tiny model). Without tools, a turn has no calls."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
        self.tokenizer, self.schemas = tokenizer, schemas
        self.stop_ids = (self._token(")"),) if schemas else ()  # a plain call ends at its ")"

    def _token(self, text: str) -> int:
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise ValueError(f"the model's tokenizer writes {text!r} as {len(ids)} tokens: "
                             "a tool call's end must be one token to stop a turn at it")
        return ids[0]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def said_text(self, text: str) -> str:
        """A turn's text as its assistant message holds it."""
        return text

    def parse(self, episode: Episode, text: str) -> ParsedTurn:
        return parse_plain(text, self.schemas) if self.schemas else ParsedTurn(text.strip())

    def observation(self, episode: Episode, turn: ParsedTurn, text: str,
                    results: list[Any]) -> list[int]:
        """The observation's tokens: each result's text between brackets (`[!]`: failed)."""
        shown = "".join(render_plain(r.content, r.error) for r in results)
        shown += "".join(render_plain("", "bad") for _ in turn.bad)
        return self.tokenizer(shown, add_special_tokens=False).input_ids

    def opening(self, messages: list[Message]) -> tuple[Any, str, list[int]]:
        """An environment's opening as a prompt, text and tokens (`Row`'s): their contents
        one after another, read as a text row's prompt is (special tokens added)."""
        text = contents(messages)
        return text, text, self.tokenizer(text).input_ids

    def env_observation(self, episode: Episode, messages: list[Message]) -> list[int]:
        """An environment's observation messages as tokens: their contents as they are."""
        return self.tokenizer(contents(messages), add_special_tokens=False).input_ids


class ChatTranscript(Transcript):
    """The chat template's form: calls in Hermes' `<tool_call>` markup (or the tokenizer's
    own response parser), results as `tool` messages rendered by the template. The
    observation is what the template writes after the model's own tokens: the end of the
    assistant turn, the tool messages and the next turn's opening."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], form: str) -> None:
        self.tokenizer, self.schemas, self.form = tokenizer, schemas, form
        self.stop_ids = (self._token("</tool_call>"),) if schemas else ()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def said_text(self, text: str) -> str:
        """Without the end-of-turn token: the template writes it after the content."""
        return text.removesuffix(self.tokenizer.eos_token or "")

    def parse(self, episode: Episode, text: str) -> ParsedTurn:
        text = self.said_text(text)
        if not self.schemas:
            return ParsedTurn(text.strip())
        if self.form == "template":
            return parse_template(self.tokenizer, text, episode.row.text, self.schemas)
        return parse_hermes(text)

    def observation(self, episode: Episode, turn: ParsedTurn, text: str,
                    results: list[Any]) -> list[int]:
        return self._after(episode, observations(turn, [r.content for r in results]))

    def opening(self, messages: list[Message]) -> tuple[Any, str, list[int]]:
        """The chat template's rendering, as a chat row's prompt is."""
        text = self.tokenizer.apply_chat_template(messages, tools=self.schemas or None,
                                                  tokenize=False, add_generation_prompt=True)
        return list(messages), text, self.tokenizer(text, add_special_tokens=False).input_ids

    def env_observation(self, episode: Episode, messages: list[Message]) -> list[int]:
        return self._after(episode, messages)

    def _after(self, episode: Episode, shown: list[Message]) -> list[int]:
        """The tokens the template writes after the model's own for `shown` messages."""
        said = [*episode.said, *shown]
        rendered = self.tokenizer.apply_chat_template(
            [*episode.row.prompt, *said], tools=self.schemas or None, tokenize=False,
            add_generation_prompt=True)
        written = episode.row.text + self.decode(episode.tokens)
        if not rendered.startswith(written):
            raise ValueError("the chat template does not render the conversation as the "
                             f"model wrote it: {written[-80:]!r} is not a prefix of "
                             f"{rendered[len(episode.row.text):][:160]!r}; use a template "
                             "that renders an assistant message's content as it is")
        episode.said = said
        return self.tokenizer(rendered[len(written):], add_special_tokens=False).input_ids


def make_transcript(tokenizer: Any, schemas: list[dict[str, Any]], form: str) -> Transcript:
    """`rollout.tool_format`'s transcript: auto is the chat template's form where the
    tokenizer has a chat template, else the plain one."""
    if form == "plain" or form == "auto" and not getattr(tokenizer, "chat_template", None):
        return Transcript(tokenizer, schemas)
    return ChatTranscript(tokenizer, schemas, "hermes" if form == "auto" else form)

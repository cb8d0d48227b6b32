"""A step's multi-turn episodes (`episodes.py`) in figures: the row's `episode_*` counts
(turns, tool calls, errors, tool time, how they ended) and how much of their prefixes the
generator replicas kept between turns (`prefix_*`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colocate.engines.sampling import PrefixCounts

if TYPE_CHECKING:
    from examples.rl_loop.transcripts import Episode


def episode_metrics(episodes: list[Episode]) -> dict[str, Any]:
    """A step's episodes in figures: turns, calls, errors, tool time, how they ended."""
    n = len(episodes)
    ended: dict[str, int] = {}
    for episode in episodes:
        ended[episode.ended] = ended.get(episode.ended, 0) + 1
    calls = sum(e.calls for e in episodes)
    return {"finished_samples": n,
            "episode_turns_mean": sum(e.turns for e in episodes) / n,
            "episode_tool_calls_mean": calls / n,
            "episode_bad_calls": sum(e.bad_calls for e in episodes),
            "episode_tool_errors": sum(e.tool_errors for e in episodes),
            "episode_tool_seconds_mean": sum(e.tool_seconds for e in episodes) / max(1, calls),
            "episode_overflows": ended.get("overflow", 0),
            "episode_ended": dict(sorted(ended.items())),
            "episode_tokens_mean": sum(len(e.tokens) for e in episodes) / n,
            "episode_trained_tokens_mean": sum(sum(e.trained) for e in episodes) / n}


def prefix_metrics(counts: PrefixCounts) -> dict[str, Any]:
    """Of the tokens an episode's earlier turns computed keys and values for, those its
    next turn's replica still had (`reused`: the same replica, its session cache kept) and
    those computed again (`recomputed`: another replica, or the cache released by a switch
    or its bound); a first turn's tokens are new, neither."""
    return {"prefix_reused_tokens": counts.reused,
            "prefix_recomputed_tokens": counts.recomputed,
            "prefix_recompute_share": counts.recompute_share}

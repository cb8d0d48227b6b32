"""The switch timeline: the recent pauses/resumes with their timing and memory, saved,
summarised, plotted."""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from itertools import islice
from os import PathLike
from pathlib import Path
from typing import Any

OPS = ("pause", "resume")
GIB = 1 << 30

# How many events a timeline keeps by default: the most recent 4096, about 2 MiB, the RL
# loop's last 512 steps at 8 events a step. Bounded because a proc's timeline lives as long
# as the proc: an unbounded one grows its RSS with every step (bench/RESULTS.md, "Where the
# telemetry defaults come from").
DEFAULT_MAX_EVENTS = 4096
# Sets the process-wide timeline's bound (read once, at import): a count of events, or 0
# to keep every event.
MAX_EVENTS_ENV = "COLOCATE_TIMELINE_EVENTS"


@dataclass
class SwitchEvent:
    """One pause or resume of a tag's memory on one device, as measured by the process doing it."""

    op: str  # "pause" | "resume"
    tag: str
    nbytes: int  # bytes the op moved or released
    seconds: float  # duration of the op
    before_bytes: int  # device memory measured just before the op
    after_bytes: int  # device memory measured just after the op
    device: str  # "cpu" or "cuda:<index>"
    start: float  # time.time() when the op started
    pid: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"SwitchEvent.op must be one of {OPS}, not {self.op!r}")

    @property
    def released_bytes(self) -> int:
        """Memory the pause gave back (before - after); 0 for a resume."""
        return self.before_bytes - self.after_bytes if self.op == "pause" else 0

    @property
    def gbps(self) -> float:
        """Throughput of the op in GB/s (1e9 bytes); 0 when it took no measurable time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Timeline:
    """A thread-safe ring of the most recent switch events, oldest first.

    It keeps at most `max_events` events (None: every one); recording beyond that forgets
    the oldest and counts it in `dropped`, so a long run's memory stays bounded and the
    ring is never mistaken for the whole history (`to_dict`/`to_json` and `plot` say how
    many were dropped). `recorded` counts every event ever recorded; a reader that polls
    remembers it and asks `since(recorded)` for what came after.
    """

    def __init__(self, events: list[SwitchEvent] | None = None,
                 max_events: int | None = DEFAULT_MAX_EVENTS, dropped: int = 0) -> None:
        if max_events is not None and max_events < 1:
            raise ValueError(f"Timeline max_events must be >= 1 or None, not {max_events}")
        if dropped < 0:
            raise ValueError(f"Timeline dropped must be >= 0, not {dropped}")
        self._lock = threading.Lock()
        self._events: deque[SwitchEvent] = deque(maxlen=max_events)
        self._dropped = dropped
        for event in events or []:
            self.record(event)

    def record(self, event: SwitchEvent) -> None:
        """Append one event, forgetting the oldest when the ring is full."""
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._dropped += 1
            self._events.append(event)

    @property
    def events(self) -> list[SwitchEvent]:
        """A copy of the events held, in the order they were recorded."""
        with self._lock:
            return list(self._events)

    @property
    def max_events(self) -> int | None:
        """The most events held at once (None: no bound)."""
        return self._events.maxlen

    @property
    def dropped(self) -> int:
        """Events forgotten because the ring was full (since the last `clear`)."""
        with self._lock:
            return self._dropped

    @property
    def recorded(self) -> int:
        """Events recorded since the last `clear`: those held plus those dropped."""
        with self._lock:
            return self._dropped + len(self._events)

    def since(self, recorded: int) -> list[SwitchEvent]:
        """The events recorded after the first `recorded` ones (a value of `recorded` read
        earlier). Raises LookupError when some of them were dropped already: the reader
        waited longer than the ring holds."""
        with self._lock:
            if recorded < self._dropped:
                raise LookupError(
                    f"the timeline dropped {self._dropped - recorded} of the events recorded "
                    f"after the first {recorded} (it holds the last {self._events.maxlen}): "
                    f"read it more often, or raise its bound ({MAX_EVENTS_ENV})")
            return list(islice(self._events, recorded - self._dropped, None))

    def clear(self) -> None:
        """Forget every event, and the count of dropped ones."""
        with self._lock:
            self._events.clear()
            self._dropped = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: {"events": [<SwitchEvent fields>, ...], "dropped": <events
        forgotten before the first one here>, "max_events": <the bound, or None>}."""
        with self._lock:
            events, dropped = list(self._events), self._dropped
        return {"events": [asdict(event) for event in events], "dropped": dropped,
                "max_events": self.max_events}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """The inverse of `to_dict` (a dict without "max_events" or "dropped", written
        before the timeline had a bound, gives an unbounded one with none dropped)."""
        return cls([SwitchEvent(**event) for event in data["events"]],
                   max_events=data.get("max_events"), dropped=data.get("dropped", 0))

    def to_json(self, path: str | PathLike[str]) -> None:
        """Write `to_dict()` as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_json(cls, path: str | PathLike[str]) -> Timeline:
        """Read a timeline written by `to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> list[dict[str, Any]]:
        """Per tag, in order of first appearance, over the events held (not the dropped
        ones): pauses, resumes, total_bytes, mean_seconds, mean_gbps (the mean of the
        events' GB/s)."""
        by_tag: dict[str, list[SwitchEvent]] = {}
        for event in self.events:
            by_tag.setdefault(event.tag, []).append(event)
        return [
            {
                "tag": tag,
                "pauses": sum(e.op == "pause" for e in events),
                "resumes": sum(e.op == "resume" for e in events),
                "total_bytes": sum(e.nbytes for e in events),
                "mean_seconds": sum(e.seconds for e in events) / len(events),
                "mean_gbps": sum(e.gbps for e in events) / len(events),
            }
            for tag, events in by_tag.items()
        ]

    def plot(self, path: str | PathLike[str]) -> None:
        """Write a PNG of memory per device over time, with a marker per switch coloured by
        tag; the title says how many older events the ring dropped, if any.

        Uses its own Agg canvas, so pyplot's global backend and state are left untouched.
        """
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        with self._lock:
            held, dropped = list(self._events), self._dropped
        events = sorted(held, key=lambda e: e.start)
        t0 = events[0].start if events else 0.0
        fig = Figure(figsize=(10, 5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()

        greys = ("black", "dimgray", "darkgray", "silver")  # devices in grey, tags in colour
        by_device: dict[str, list[SwitchEvent]] = {}
        for e in events:
            by_device.setdefault(e.device, []).append(e)
        for i, (device, ops) in enumerate(sorted(by_device.items())):
            xs = [x for e in ops for x in (e.start - t0, e.start + e.seconds - t0)]
            ys = [y / GIB for e in ops for y in (e.before_bytes, e.after_bytes)]
            ax.plot(xs, ys, drawstyle="steps-post", color=greys[i % 4], label=device)

        palette = matplotlib.colormaps["tab10"]
        tags = dict.fromkeys(e.tag for e in events)  # in order of first appearance
        tag_color = {tag: palette(i % 10) for i, tag in enumerate(tags)}
        for e in events:
            linestyle = "--" if e.op == "pause" else ":"
            ax.axvline(e.start - t0, color=tag_color[e.tag], linestyle=linestyle, alpha=0.7)
        handles, _ = ax.get_legend_handles_labels()
        handles += [Line2D([], [], color=color, label=tag) for tag, color in tag_color.items()]
        handles += [
            Line2D([], [], color="grey", linestyle="--", label="pause"),
            Line2D([], [], color="grey", linestyle=":", label="resume"),
        ]
        ax.legend(handles=handles, loc="upper right", fontsize="small")
        ax.set_title("memory timeline" if not dropped else
                     f"memory timeline: the last {len(events)} events "
                     f"({dropped} older ones dropped)")
        ax.set_xlabel("seconds since first event")
        ax.set_ylabel("memory (GiB)")
        fig.savefig(path, format="png")


def max_events_from(environ: Mapping[str, str]) -> int | None:
    """The bound `MAX_EVENTS_ENV` sets in `environ`: DEFAULT_MAX_EVENTS when unset, None
    (keep every event) for 0."""
    value = environ.get(MAX_EVENTS_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_EVENTS
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{MAX_EVENTS_ENV} must be a count of events >= 0 (0: keep every "
                         f"event), not {value!r}")
    return count or None


_default = Timeline(max_events=max_events_from(os.environ))


def timeline() -> Timeline:
    """The process-wide timeline that the runtime records its switches into."""
    return _default

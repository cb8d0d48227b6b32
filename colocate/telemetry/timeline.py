"""The switch timeline: each pause/resume with its timing and memory, saved, summarised, plotted."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from os import PathLike
from pathlib import Path
from typing import Any

OPS = ("pause", "resume")
GIB = 1 << 30


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
    """A thread-safe, append-only list of switch events."""

    def __init__(self, events: list[SwitchEvent] | None = None) -> None:
        self._lock = threading.Lock()
        self._events: list[SwitchEvent] = list(events or [])

    def record(self, event: SwitchEvent) -> None:
        """Append one event."""
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[SwitchEvent]:
        """A copy of the events, in the order they were recorded."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        """Forget every event."""
        with self._lock:
            self._events.clear()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: {"events": [<SwitchEvent fields>, ...]}."""
        return {"events": [asdict(event) for event in self.events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """The inverse of `to_dict`."""
        return cls([SwitchEvent(**event) for event in data["events"]])

    def to_json(self, path: str | PathLike[str]) -> None:
        """Write `to_dict()` as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_json(cls, path: str | PathLike[str]) -> Timeline:
        """Read a timeline written by `to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> list[dict[str, Any]]:
        """Per tag, in order of first appearance: pauses, resumes, total_bytes, mean_seconds,
        mean_gbps (the mean of the events' GB/s)."""
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
        """Write a PNG of memory per device over time, with a marker per switch coloured by tag.

        Uses its own Agg canvas, so pyplot's global backend and state are left untouched.
        """
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        events = sorted(self.events, key=lambda e: e.start)
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
        ax.set_title("memory timeline")
        ax.set_xlabel("seconds since first event")
        ax.set_ylabel("memory (GiB)")
        fig.savefig(path, format="png")


_default = Timeline()


def timeline() -> Timeline:
    """The process-wide timeline that the runtime records its switches into."""
    return _default

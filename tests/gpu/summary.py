"""One summary of a GPU session's run (`device.sh run`): the GPU it ran on, each part's
time against its budget (and the parts skipped for lack of time), every GPU test by name
with its outcome, then each benchmark's printed table.

    python tests/gpu/summary.py OUT_DIR [run|bench] > OUT_DIR/summary.md

Reads OUT_DIR/gpu.txt (`nvidia-smi -L`: which kind of GPU each figure came from),
OUT_DIR/budget.log (device.sh's line per part), OUT_DIR/gpu-tests*.xml (pytest's JUnit
XML, one per part that ran tests), OUT_DIR/bench-*.log (what each benchmark printed) and
OUT_DIR/rl-loop-metrics.json and rl-loop-capped-metrics.json (the RL loop's runs on the GPU,
with the GPU's memory and capped: switch share, step time, devices, bytes moved against
required; the run's plan against it: each figure predicted, measured and the error; also
the share from the second step on, the first step's being apart); a missing file is named
in the summary, never skipped silently. `bench` (`device.sh
bench`, benchmarks only) leaves out the tests and the RL loop.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL_LINES = 40  # of a benchmark's output: its table and verdicts
RL_FIELDS = ("failed", "switch_share", "mean_step_s", "devices", "untrained_eval_reward",
             "final_eval_reward", "policy", "slot_capacity_bytes", "bytes_moved_per_step",
             "bytes_required_per_step", "slot_peak_bytes")  # of its summary, where it has them
RL_RUNS = {"rl-loop-metrics.json": "RL loop on the GPU",  # the budget policy, ample
           "rl-loop-capped-metrics.json": "RL loop on the GPU, slot capped"}


def test_outcomes(xml: Path) -> dict[str, list[str]]:
    """outcome ("passed", "failed", "skipped") -> the tests' ids, from JUnit XML."""
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes["failed"].append(name)
        elif case.find("skipped") is not None:
            outcomes["skipped"].append(name)
        else:
            outcomes["passed"].append(name)
    return outcomes


def summary(out: Path, mode: str = "run") -> str:
    lines = ["# GPU session summary", ""]
    gpu = out / "gpu.txt"
    lines.append("device: " + ("; ".join(gpu.read_text().split("\n")).strip("; ")
                               if gpu.exists() else f"unknown (no {gpu.name})"))
    budget = out / "budget.log"
    if budget.exists():
        lines += ["", "## time budget", *(f"- {line.removeprefix('budget: ')}"
                                          for line in budget.read_text().splitlines()
                                          if line.strip())]
    lines.append("")
    if mode == "run":
        lines += run_sections(out)
    for log in sorted(out.glob("bench-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        lines += ["", f"## {log.stem}", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def run_sections(out: Path) -> list[str]:
    """The tests by outcome and the RL loop's figures."""
    lines: list[str] = []
    xmls = sorted(out.glob("gpu-tests*.xml"))
    if xmls:
        outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
        for xml in xmls:
            for outcome, names in test_outcomes(xml).items():
                outcomes[outcome] += names
        lines.append("tests: " + ", ".join(f"{len(v)} {k}" for k, v in outcomes.items())
                     + f" ({', '.join(xml.name for xml in xmls)})")
        for outcome, names in outcomes.items():
            lines += ["", f"## {outcome}", *(f"- {name}" for name in names)]
    else:
        lines.append("tests: no gpu-tests.xml (pytest did not get to write it)")
    for name, title in RL_RUNS.items():
        lines += rl_run(out / name, title)
    return lines


def rl_run(metrics: Path, title: str) -> list[str]:
    """One RL-loop run's figures (see module)."""
    lines = ["", f"## {title}"]
    if metrics.exists():
        run = json.loads(metrics.read_text())
        steps = [s for s in run.get("steps", []) if s.get("step", -1) >= 0]
        lines += [f"- {key}: {run['summary'][key]}" for key in RL_FIELDS
                  if key in run.get("summary", {})]
        plan = run.get("summary", {}).get("plan", {})
        lines += [f"- plan {key}: predicted {plan[key]['predicted']:.6g}, measured "
                  f"{plan[key]['measured']:.6g}, error {plan[key]['error']:+.3f}"
                  for key in ("bytes_moved", "switch_time", "peak_slot", "peak_host")
                  if isinstance(plan.get(key), dict)]
        for key in ("switch_s", "sync_s", "step_s"):
            values = [s[key] for s in steps if key in s]
            if values:
                lines.append(f"- mean {key} over {len(values)} steps: "
                             f"{sum(values) / len(values):.4f}")
        later = [(s["switch_s"] + s["sync_s"]) / s["step_s"] for s in steps[1:]
                 if {"switch_s", "sync_s", "step_s"} <= s.keys()]
        if later:
            lines.append(f"- switch share from the second step on (median of "
                         f"{len(later)}): {statistics.median(later):.3f}")
    else:
        lines.append(f"no {metrics.name} (the run did not get to write it)")
    return lines


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]), *sys.argv[2:3]), end="")

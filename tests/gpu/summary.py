"""One summary of a GPU session's run (`device.sh run`): every GPU test by name with its
outcome, then each benchmark's printed table.

    python tests/gpu/summary.py OUT_DIR > OUT_DIR/summary.md

Reads OUT_DIR/gpu-tests.xml (pytest's JUnit XML) and OUT_DIR/bench-*.log (what each
benchmark printed); a missing file is named in the summary, never skipped silently.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL_LINES = 40  # of a benchmark's output: its table and verdicts


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


def summary(out: Path) -> str:
    lines = ["# GPU session summary", ""]
    xml = out / "gpu-tests.xml"
    if xml.exists():
        outcomes = test_outcomes(xml)
        lines.append("tests: " + ", ".join(f"{len(v)} {k}" for k, v in outcomes.items()))
        for outcome, names in outcomes.items():
            lines += ["", f"## {outcome}", *(f"- {name}" for name in names)]
    else:
        lines.append(f"tests: no {xml.name} (pytest did not get to write it)")
    for log in sorted(out.glob("bench-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        lines += ["", f"## {log.stem}", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])), end="")

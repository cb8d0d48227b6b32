"""The slot capacity of `device.sh run`'s capped RL-loop run: what the ample run's slot
held at most after its switches (the CUDA context and the allocator's caches with it),
less the generator's weights and working memory, with 2% of the trainer to spare. The
trainer then fits alone, beside nothing of the generator, as under the exclusive policy;
what the budget moves there is held against what that capacity requires.

    python tests/gpu/slot_cap.py AMPLE_METRICS_JSON OVERRIDE... > prints the capacity
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from examples.rl_loop.budget import tenant_sizes
from examples.rl_loop.config import load_config


def main() -> None:
    metrics = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(overrides=sys.argv[2:])
    sizes = tenant_sizes(cfg, Path(cfg.run.out) / "base_model")
    peak = metrics["summary"]["slot_peak_bytes"]
    print(int(peak - sizes["generator"].total + 0.02 * sizes["trainer"].total))


if __name__ == "__main__":
    main()

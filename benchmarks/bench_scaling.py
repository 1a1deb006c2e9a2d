"""Planning time against depth: GPT (hidden 4096) on an (8, 8) mesh, 4 to 96 layers.

Repeated layers share variables (autopar/solver/layers.py), so the ILP stays the size of three
layers and the solve time flat; capture and cost tables still grow linearly with the graph.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    print(f"{'layers':>6} {'wall s':>8} {'solve s':>8} {'ILP vars':>9} {'RSS MiB':>8}")
    for layers in (4, 8, 16, 32, 64, 96):
        out = subprocess.run([sys.executable, os.path.join(HERE, "bench_plan_gpt.py"), "--layers", str(layers),
                              "--hidden", "4096", "--heads", "32", "--seq", "2048", "--batch", "16", "--mesh", "8,8"],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{layers:>6} {r['wall_s']:>8.2f} {r['solve_s']:>8.2f} {r['ilp_variables']:>9} {r['peak_rss_mib']:>8.0f}",
              flush=True)


if __name__ == "__main__":
    main()

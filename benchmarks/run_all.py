"""`make bench`: every benchmark, one JSON line each (quoted in issue notes)."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# each in its own process so peak RSS is that benchmark's own
RUNS = [
    ["bench_plan_gpt.py", "--layers", "24", "--hidden", "2048", "--heads", "16", "--mesh", "8,8"],   # GPT 1.3B
    ["bench_plan_gpt.py", "--layers", "2", "--hidden", "2048", "--heads", "16", "--mesh", "8,8"],
    ["bench_plan_gpt.py", "--layers", "4", "--hidden", "1024", "--heads", "16", "--mesh", "2,2,2",
     "--seq", "1024", "--batch", "16"],
]


def main() -> int:
    rc = 0
    for args in RUNS:
        print("$ python benchmarks/" + " ".join(args), flush=True)
        rc |= subprocess.call([sys.executable, os.path.join(HERE, args[0]), *args[1:]])
    return rc


if __name__ == "__main__":
    sys.exit(main())

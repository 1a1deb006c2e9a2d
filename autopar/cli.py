"""The `autopar` command line.

    autopar calibrate [--out my.json] [--world-size 4] [--mesh 2,2] [--base cpu] [--quick]

`calibrate` measures this machine and writes a device profile that `Mesh(device="my.json")`
accepts; what it measures and how: `autopar/cost_model/calibrate.py`.
"""
from __future__ import annotations

import argparse
import sys

from .cost_model.calibrate import calibrate

__all__ = ["main", "calibrate"]


# -- command line ----------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="measure this machine and write a device profile JSON")
    c.add_argument("--out", default="calibrated.json", help="profile file to write (default calibrated.json)")
    c.add_argument("--world-size", type=int, default=2, help="ranks measuring at once (default 2)")
    c.add_argument("--mesh", default=None, help="mesh shape whose axes to measure, e.g. 2,2 (default: one axis)")
    c.add_argument("--base", default="cpu", help="profile for figures not measured (default cpu)")
    c.add_argument("--name", default=None, help="profile name (default calibrated-<device>)")
    c.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    c.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds, rough)")
    a = ap.parse_args(argv)
    if a.command == "calibrate":
        mesh = tuple(int(x) for x in a.mesh.split(",")) if a.mesh else None
        path = calibrate(a.out, world_size=a.world_size, mesh=mesh, base=a.base, name=a.name, quick=a.quick,
                         device=a.device)
        from .cost_model.profiles import load_profile
        p = load_profile(path)
        print(f"wrote {path}: fp32 {p.peak_flops['float32'] / 1e9:.1f} GFLOP/s, bf16 "
              f"{p.peak_flops.get('bfloat16', 0) / 1e9:.1f} GFLOP/s, memory {p.memory_bandwidth / 1e9:.1f} GB/s, "
              f"link {p.intra_node.bandwidth / 1e9:.2f} GB/s + {p.intra_node.latency * 1e6:.0f} us per step, "
              f"op overhead {p.kernel_overhead * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

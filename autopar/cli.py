"""The `autopar` command line: plan a model from the shell, read and compare plans, price steps.

examples:
  autopar plan my_models:small --mesh 2x2 --axes dp,tp --device h100 --json plan.json --html plan.html
  autopar plan --hf-config config.json --batch 8 --seq 1024 --mesh 8x8 --axes dp,tp --time-limit 60
  autopar report plan.json --html plan.html
  autopar diff before.json after.json
  autopar estimate --plan plan.json --batch 64
  autopar estimate my_models:small --mesh 2x2 --axes dp,tp --plan plan.json
  autopar explain my_models:small --plan plan.json --name blocks.0.fc.weight
  autopar calibrate --out me.json

A model is MODULE:FUNCTION, where FUNCTION() returns (model, example_inputs) and MODULE is
importable from the current directory, or --hf-config: a Hugging Face config.json whose causal
LM is built on the meta device in bf16 (no weights, no downloads). Exit status: 0 success,
1 `diff` found differences, 2 bad input (the message says what to change).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .calibrate import calibrate
from .errors import AutoparError, MeshError

__all__ = ["main", "calibrate"]

GIB = 2**30
HF_BATCH, HF_SEQ = 8, 1024      # --hf-config's default global batch and sequence length


class CliError(AutoparError):
    """A command-line argument that cannot be used as given."""


# -- arguments -------------------------------------------------------------------------------
def _model_args(p: argparse.ArgumentParser, required_mesh: bool = True) -> None:
    g = p.add_argument_group("model (MODULE:FUNCTION or --hf-config)")
    g.add_argument("model", nargs="?", help="MODULE:FUNCTION returning (model, example_inputs)")
    g.add_argument("--hf-config", metavar="JSON", help="a Hugging Face config.json: its causal LM on meta, bf16")
    g.add_argument("--batch", type=int, help=f"global batch for --hf-config (default {HF_BATCH}); with "
                                              f"`estimate --plan` alone, the batch to re-price at")
    g.add_argument("--seq", type=int, help=f"sequence length for --hf-config (default {HF_SEQ}); likewise")
    g.add_argument("--layers", type=int, help="override the config's number of layers (--hf-config)")
    m = p.add_argument_group("mesh")
    m.add_argument("--mesh", help="mesh shape, e.g. 8x8 (or 8,8)" + (" (or give --cluster)" if required_mesh else ""))
    m.add_argument("--cluster", metavar="NODESxDEVICES", help="nodes x devices per node, e.g. 128x8, instead of "
                                                             "--mesh: the planner chooses the mesh (docs/mesh_search.md)")
    m.add_argument("--axes", help="axis names, e.g. dp,tp (default axis0,axis1,...)")
    m.add_argument("--device", help="device profile: a100, h100, h200, cpu or a profile JSON (default h100; "
                                    "for explain, the plan's)")
    m.add_argument("--batch-axes", help="mesh axes the inputs arrive split over on dim 0, e.g. dp")


def _plan_option_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan options")
    g.add_argument("--time-limit", type=float, default=60.0, help="solver seconds (default 60)")
    g.add_argument("--memory-budget", type=float, metavar="GIB", help="GiB per device (default: the device's)")
    g.add_argument("--pins", nargs="+", default=[], metavar="NAME=LAYOUT",
                   help="fix layouts, one placement per mesh axis: 'blocks.*.fc.weight=S(0),R'")
    g.add_argument("--sharded-outputs", action="store_true", help="leave outputs in their planned layout")
    g.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    g.add_argument("--cache-dir", help="reuse plans solved before (or set AUTOPAR_CACHE_DIR)")
    g.add_argument("--no-symbolic", action="store_true", help="skip pricing the plan at other batch sizes")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="plan a model: print the report, write JSON and HTML")
    _model_args(p)
    _plan_option_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the plan (autopar.Plan.load reads it)")
    o.add_argument("--html", metavar="FILE", help="write the report as one HTML page with charts")
    o.add_argument("--detail", action="store_true", help="one row per op in the printed report")
    o.add_argument("--quiet", action="store_true", help="print no report (files and errors only)")
    o.add_argument("--explain", nargs="+", default=[], metavar="NAME", help="why these nodes/parameters got "
                                                                          "their layouts")
    r = sub.add_parser("report", help="print a saved plan's report, or write it as HTML")
    r.add_argument("plan", help="plan JSON file")
    r.add_argument("--html", metavar="FILE", help="write the HTML report here (no text report then)")
    r.add_argument("--detail", action="store_true", help="one row per op")
    d = sub.add_parser("diff", help="differences between two plans (exit 1 if any)")
    d.add_argument("a")
    d.add_argument("b")
    e = sub.add_parser("estimate", help="a saved plan at another batch size, or a whole step of a model")
    _model_args(e, required_mesh=False)
    e.add_argument("--plan", metavar="FILE", help="plan JSON: alone, re-priced at --batch/--seq from its symbolic "
                                                  "costs; with a model, the layouts to price")
    e.add_argument("--pins", nargs="+", default=[], metavar="NAME=LAYOUT", help="hand-written layouts to price")
    e.add_argument("--stages", type=int, default=1, help="pipeline stages along --pipeline-axis")
    e.add_argument("--microbatches", type=int, default=1)
    e.add_argument("--pipeline-axis", default="pp")
    e.add_argument("--recompute", action="store_true", help="full activation recomputation")
    e.add_argument("--sharded-outputs", action="store_true",
                   help="leave outputs in their planned layout (the caller uses only the loss)")
    x = sub.add_parser("explain", help="why nodes or parameters got their layouts, and what else would cost")
    _model_args(x, required_mesh=False)
    x.add_argument("--plan", required=True, metavar="FILE", help="the plan JSON (its mesh is used)")
    x.add_argument("--name", nargs="+", required=True, metavar="NAME", help="node names or parameter names")
    c = sub.add_parser("calibrate", help="measure this machine and write a device profile JSON")
    c.add_argument("--out", default="calibrated.json", help="profile file to write (default calibrated.json)")
    c.add_argument("--world-size", type=int, default=2, help="ranks measuring at once (default 2)")
    c.add_argument("--mesh", default=None, help="mesh shape whose axes to measure, e.g. 2,2 (default: one axis)")
    c.add_argument("--base", default="cpu", help="profile for figures not measured (default cpu)")
    c.add_argument("--name", default=None, help="profile name (default calibrated-<device>)")
    c.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    c.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds, rough)")
    return ap


# -- argument values -------------------------------------------------------------------------
def parse_mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(","))
    except ValueError:
        raise MeshError(f"--mesh {text!r} is not a shape such as 8x8 or 2,4") from None
    return shape


def _mesh(a):
    from .cluster import Cluster
    from .mesh import Mesh
    if a.cluster:
        if a.mesh or a.axes:
            raise CliError("give --cluster (the planner chooses the mesh) or --mesh/--axes, not both")
        return Cluster.parse(a.cluster, a.device or "h100")
    if not a.mesh:
        raise CliError("give the mesh: --mesh 8x8 --axes dp,tp (or the cluster: --cluster 2x8)")
    shape = parse_mesh_shape(a.mesh)
    return Mesh(shape, a.axes.split(",") if a.axes else None, a.device or "h100")


def _list(text: str | None) -> tuple[str, ...] | None:
    return tuple(s for s in text.split(",") if s) if text else None


def parse_pins(items: list[str]) -> dict[str, tuple[str, ...]]:
    pins = {}
    for item in items:
        name, sep, layout = item.partition("=")
        if not sep or not name or not layout:
            raise CliError(f"pin {item!r} is not NAME=LAYOUT, e.g. 'blocks.*.fc.weight=S(0),R'")
        pins[name] = tuple(p.strip() for p in layout.split(","))
    return pins


def _source(a):
    from .model_source import load_function, load_hf_config
    if a.hf_config and a.model:
        raise CliError(f"give MODULE:FUNCTION ({a.model}) or --hf-config ({a.hf_config}), not both")
    if a.hf_config:
        return load_hf_config(a.hf_config, a.batch or HF_BATCH, a.seq or HF_SEQ, a.layers)
    if not a.model:
        raise CliError("no model: give MODULE:FUNCTION (e.g. my_models:small) or --hf-config config.json")
    return load_function(a.model)


def _load_plan(path: str):
    from .errors import PlanFileError
    from .plan import Plan
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read plan {path!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return Plan.from_json(text, source=path)      # read as data: every field checked (plan_file.py)
    except PlanFileError as e:
        raise CliError(str(e)) from None


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise CliError(f"cannot write {path!r}: {e.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)


# -- commands --------------------------------------------------------------------------------
def cmd_plan(a) -> int:
    import autopar
    mesh, src = _mesh(a), _source(a)
    plan = autopar.plan(src.model, src.args, mesh, example_kwargs=src.kwargs,
                        memory_budget=a.memory_budget * GIB if a.memory_budget else None, pins=parse_pins(a.pins),
                        batch_axes=_list(a.batch_axes), sharded_outputs=a.sharded_outputs, optimizer=a.optimizer,
                        time_limit=a.time_limit, cache_dir=a.cache_dir, symbolic=not a.no_symbolic)
    if not a.quiet:
        print(plan.report(detail=a.detail))
    if a.json:
        _write(a.json, plan.to_json())
    if a.html:
        _write(a.html, plan.to_html())
    for name in a.explain:
        print(autopar.explain(src.model, src.args, _plan_mesh(plan, a.device), plan, name, example_kwargs=src.kwargs))
    return 0


def cmd_report(a) -> int:
    plan = _load_plan(a.plan)
    if a.html:
        _write(a.html, plan.to_html())
    else:
        print(plan.report(detail=a.detail))
    return 0


def cmd_diff(a) -> int:
    pa, pb = _load_plan(a.a), _load_plan(a.b)
    lines = pa.diff(pb)
    gib = lambda b: f"{b / GIB:.3f} GiB"  # noqa: E731
    if pa.estimate.peak_memory_bytes != pb.estimate.peak_memory_bytes:
        lines.append(f"peak memory: {gib(pa.estimate.peak_memory_bytes)} -> {gib(pb.estimate.peak_memory_bytes)}")
    if pa.fingerprint != pb.fingerprint:
        lines.insert(0, f"graphs differ (fingerprint {pa.fingerprint} -> {pb.fingerprint}): another model or shapes")
    print("\n".join(lines) if lines else "the plans are the same")
    return 1 if lines else 0


def cmd_estimate(a) -> int:
    import autopar
    if not a.model and not a.hf_config:      # a saved plan at other sizes
        if not a.plan:
            raise CliError("give --plan plan.json (re-price it at --batch/--seq) or a model to price a step of")
        plan = _load_plan(a.plan)
        try:
            e = plan.estimate_at(batch=a.batch, seq=a.seq)
        except ValueError as err:
            raise CliError(str(err)) from None
        where = f"batch {a.batch or plan.scaling.batch}" + (f", seq {a.seq}" if a.seq else "")
        print(f"at {where}: step {e.step_time_s * 1e3:.3f} ms (compute {e.compute_s * 1e3:.3f} ms, "
              f"communication {e.comm_s * 1e3:.3f} ms), peak memory {e.peak_memory_bytes / GIB:.3f} GiB per device; "
              f"largest batch that fits: {plan.largest_batch()}")
        return 0
    mesh, src = _mesh(a), _source(a)
    layouts = _load_plan(a.plan) if a.plan else (parse_pins(a.pins) or None)
    pipe = (autopar.Pipeline(stages=a.stages, microbatches=a.microbatches, axis=a.pipeline_axis)
            if a.stages > 1 or a.microbatches > 1 else None)
    try:       # given only when asked: a plan decides its own pipeline and recomputation
        est = autopar.estimate(src.model, src.args, mesh, layouts, example_kwargs=src.kwargs,
                               batch_axes=_list(a.batch_axes), sharded_outputs=a.sharded_outputs, pipeline=pipe,
                               recompute=a.recompute or None)
    except ValueError as e:      # estimate's argument checks (pipeline axis, sizes)
        raise CliError(str(e)) from None
    print(est.report())
    return 0


def cmd_explain(a) -> int:
    import autopar
    plan = _load_plan(a.plan)
    mesh = _plan_mesh(plan, a.device)
    src = _source(a)
    for name in a.name:
        print(autopar.explain(src.model, src.args, mesh, plan, name, example_kwargs=src.kwargs))
    return 0


def _plan_mesh(plan, device: str | None):
    """The mesh a plan records (on its cluster where the planner chose it: `autopar.Cluster`)."""
    from .cluster import Cluster
    from .mesh import Mesh
    m = plan.mesh
    if "devices_per_node" in m:
        return Cluster(m["nodes"], m["devices_per_node"], device or m["device"]).mesh_of(m)
    return Mesh(tuple(m["shape"]), m["axis_names"], device or m["device"])


def cmd_calibrate(a) -> int:
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


COMMANDS = {"plan": cmd_plan, "report": cmd_report, "diff": cmd_diff, "estimate": cmd_estimate,
            "explain": cmd_explain, "calibrate": cmd_calibrate}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return COMMANDS[a.command](a)
    except AutoparError as e:
        print(f"autopar {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

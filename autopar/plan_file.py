"""Reading a plan (file, JSON text or dict) as data: every field checked, nothing evaluated.

Plan files and plan-cache files come from disk, other jobs and other people. `read_plan` checks
each field's type and range before building the `Plan`: the format version, the mesh (positive
sizes, one unique name per axis), every layout (one placement per mesh axis, `R`, `S(d)` with
d >= 0, `P`, `P(sum|avg|max|min)`), the executors, the memory decisions (`RECOMPUTE_MODES`,
`RESIDENCY_MODES`, `TIERS`), and every cost expression (parsed by `autopar.expr`'s grammar,
never by `eval` or sympy). Any problem is a `PlanFileError` naming the file and the field
("plan.json: nodes[3].output[1]: ..."). Unknown fields are errors too: a misspelt field is not
silently dropped.

What a plan must match in a model (shard dims the tensors have, sizes that divide) is checked
when the plan is applied (`autopar.api.check_plan`), where the model is known.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from torch.distributed.tensor import Partial, Shard

from .errors import PlanFileError
from .expr import ExprError, compile_expr
from .placement import from_str, parse_pin
from .plan_records import (OFFLOAD_CLASSES, PIPELINE_SCHEDULES, PLAN_FORMAT_VERSION, RECOMPUTE_MODES, RESIDENCY_MODES,
                   MESH_CANDIDATE_STATUS, PIPELINE_KEYS, TIERS, Collective, Estimate, MeshCandidate, NodePlan,
                   PipelinePlan, Scaling, SolverInfo)

__all__ = ["read_plan", "load_plan", "parse_plan_json", "EXECUTORS", "PARTIAL_OPS"]

EXECUTORS = ("param", "input", "local", "context", "replicate", "output")
PARTIAL_OPS = ("sum", "avg", "max", "min")
_PHASES = ("forward", "backward")
_CLUSTER_KEYS = ("nodes", "devices_per_node", "device_order")   # plan.mesh of a mesh chosen on a Cluster
DEVICE_ORDER = "row-major"     # autopar.cluster.DEVICE_ORDER (imported there from here: plan files know no Cluster)
_FIXED = ("batch", "seq")
_OPTION_TYPES = {"memory_budget": "number?", "pins": "pins", "batch_axes": "axes", "sharded_outputs": "bool",
                 "optimizer": "str", "symbolic": "bool", "recompute": "str", "residency": "str", "offload": "str",
                 "precision": "str", "pipeline": "pipeline", "moe_capacity_factor": "positive?",
                 "stage": "bool"}


def load_plan(cls, path: str | Path):
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{path}: cannot read the plan file ({e})") from None
    return parse_plan_json(cls, text, str(path))


def parse_plan_json(cls, text: str, source: str = "plan JSON"):
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise PlanFileError(f"{source} is not a plan: not valid JSON ({e}); the file may be truncated: re-save "
                            f"or re-plan it") from None
    return read_plan(cls, d, source)


def read_plan(cls, d: Any, source: str = "plan dict"):
    """The plan a dict (from JSON) describes, built as `cls` (`autopar.plan.Plan`, whose `from_dict`,
    `from_json` and `load` call these functions); `source` names it in errors (a file path)."""
    return _Reader(source).plan(cls, d)


class _Reader:
    def __init__(self, source: str):
        self.source = source
        self.naxes = 0
        self.axis_names: list[str] = []

    def fail(self, field: str, msg: str):
        raise PlanFileError(f"{self.source}: {field}: {msg}; re-plan the model, or restore the file autopar saved")

    # -- the plan -----------------------------------------------------------------------
    def plan(self, cls, d: Any):
        self.check_dict(d, "(top level)")
        version = d.get("version")
        if version != PLAN_FORMAT_VERSION:
            self.fail("version", f"plan format version {version!r} is not {PLAN_FORMAT_VERSION}")
        self.fields(d, "(top level)", cls, optional=("scaling",), skip=("timings", "pending_scaling"))
        mesh = self.mesh(d["mesh"])
        return cls(model=self.string(d["model"], "model"), fingerprint=self.string(d["fingerprint"], "fingerprint"),
                    mesh=mesh, options=self.options(d["options"]), nodes=self.nodes(d["nodes"]),
                    placements={k: self.layout(v, f"placements.{k}")
                                for k, v in self.mapping(d["placements"], "placements").items()},
                    estimate=self.estimate(d["estimate"]), solver=self.solver(d["solver"]),
                    fallbacks=[self.string(f, f"fallbacks[{i}]") for i, f in
                               enumerate(self.array(d.get("fallbacks", []), "fallbacks"))],
                    indivisible=[self.string(f, f"indivisible[{i}]") for i, f in
                                 enumerate(self.array(d.get("indivisible", []), "indivisible"))],
                    version=version, scaling=self.scaling(d.get("scaling")),
                    recompute=self.modes(d.get("recompute", {}), "recompute", RECOMPUTE_MODES),
                    residency=self.modes(d.get("residency", {}), "residency", RESIDENCY_MODES),
                    offload=self.offload(d.get("offload", {})),
                    pipeline=self.pipeline(d.get("pipeline", {})),
                    mesh_search=[self.mesh_candidate(c, f"mesh_search[{i}]") for i, c in
                                 enumerate(self.array(d.get("mesh_search", []), "mesh_search"))])

    def mesh(self, m: Any) -> dict:
        self.check_dict(m, "mesh")
        self.keys(m, "mesh", required=("shape", "axis_names", "device"), optional=_CLUSTER_KEYS)
        shape = [self.integer(s, f"mesh.shape[{i}]", least=1) for i, s in enumerate(self.array(m["shape"], "mesh.shape"))]
        names = [self.string(s, f"mesh.axis_names[{i}]") for i, s in
                 enumerate(self.array(m["axis_names"], "mesh.axis_names"))]
        if not shape or len(names) != len(shape) or len(set(names)) != len(names):
            self.fail("mesh", f"shape {shape} and axis_names {names} must be non-empty, of one length, names unique")
        self.naxes, self.axis_names = len(shape), names
        out = {"shape": shape, "axis_names": names, "device": self.string(m["device"], "mesh.device")}
        if any(k in m for k in _CLUSTER_KEYS):      # a mesh chosen on a Cluster (autopar/planner/mesh_search.py)
            self.keys(m, "mesh", required=("shape", "axis_names", "device") + _CLUSTER_KEYS)
            per = self.integer(m["devices_per_node"], "mesh.devices_per_node", least=1)
            nodes = self.integer(m["nodes"], "mesh.nodes", least=1)
            if nodes * per != math.prod(shape):
                self.fail("mesh", f"shape {shape} has {math.prod(shape)} devices, not nodes x devices_per_node "
                                  f"= {nodes} x {per}")
            out.update(nodes=nodes, devices_per_node=per,
                       device_order=self.choice(m["device_order"], "mesh.device_order", (DEVICE_ORDER,)))
        return out

    def mesh_candidate(self, c: Any, f: str) -> MeshCandidate:
        self.check_dict(c, f)
        self.fields(c, f, MeshCandidate)
        shape = tuple(self.integer(s, f"{f}.shape[{i}]", least=1) for i, s in enumerate(self.array(c["shape"], f"{f}.shape")))
        names = tuple(self.string(s, f"{f}.axis_names[{i}]") for i, s in
                      enumerate(self.array(c["axis_names"], f"{f}.axis_names")))
        if len(names) != len(shape):
            self.fail(f, f"shape {list(shape)} and axis_names {list(names)} differ in length")
        opt = {k: None if c.get(k) is None else self.number(c[k], f"{f}.{k}", least=0)
               for k in ("step_time_s", "peak_memory_bytes")}
        return MeshCandidate(shape, names, self.choice(c["status"], f"{f}.status", MESH_CANDIDATE_STATUS), **opt,
                             screen_s=self.number(c.get("screen_s", 0.0), f"{f}.screen_s", least=0),
                             note=self.string(c.get("note", ""), f"{f}.note"))

    def options(self, o: Any) -> dict:
        self.check_dict(o, "options")
        self.keys(o, "options", required=(), optional=tuple(_OPTION_TYPES))
        for k, v in o.items():
            kind, field = _OPTION_TYPES[k], f"options.{k}"
            if kind in ("number?", "positive?"):
                if v is not None:
                    self.number(v, field, least=0)
                if kind == "positive?" and v is not None and not 0 < v < math.inf:
                    self.fail(field, f"{v} is not a number above 0 (null: none)")
            elif kind == "bool":
                self.boolean(v, field)
            elif kind == "str":
                self.string(v, field)
            elif kind == "pipeline":
                self.pipeline_option(v, field)
            elif kind == "axes":
                for i, a in enumerate(self.array(v, field)):
                    self.choice(a, f"{field}[{i}]", self.axis_names)
            else:
                for name, lay in self.mapping(v, field).items():
                    self.pin(lay, f"{field}.{name}")
        return dict(o)

    def pipeline_option(self, v: Any, f: str) -> None:
        """The `pipeline=` option a plan was made with: null, false or an object of PIPELINE_KEYS."""
        if v is None or v is False:
            return
        self.check_dict(v, f)
        self.keys(v, f, required=(), optional=PIPELINE_KEYS)
        if "axis" in v:
            self.choice(v["axis"], f"{f}.axis", self.axis_names)
        if "schedule" in v:
            self.choice(v["schedule"], f"{f}.schedule", PIPELINE_SCHEDULES)
        for k in ("stages", "virtual_stages", "microbatches"):
            if k in v:
                self.integer(v[k], f"{f}.{k}", least=1)

    def nodes(self, ns: Any) -> list[NodePlan]:
        out = []
        for i, n in enumerate(self.array(ns, "nodes")):
            f = f"nodes[{i}]"
            self.check_dict(n, f)
            self.fields(n, f, NodePlan)
            labels = tuple(self.string(x, f"{f}.labels[{j}]") for j, x in enumerate(self.array(n["labels"], f"{f}.labels")))
            if len(labels) not in (0, self.naxes):
                self.fail(f"{f}.labels", f"{len(labels)} labels for a mesh of {self.naxes} axes")
            out.append(NodePlan(
                name=self.string(n["name"], f"{f}.name"), op=self.string(n["op"], f"{f}.op"),
                module=self.string(n["module"], f"{f}.module"),
                inputs=tuple(self.layout(x, f"{f}.inputs[{j}]") for j, x in enumerate(self.array(n["inputs"], f"{f}.inputs"))),
                output=() if n["executor"] == "output" and n["output"] in ([], ()) else self.layout(n["output"], f"{f}.output"),
                labels=labels, executor=self.choice(n["executor"], f"{f}.executor", EXECUTORS),
                compute_s=self.number(n.get("compute_s", 0.0), f"{f}.compute_s", least=0),
                collectives=tuple(self.collective(c, f"{f}.collectives[{j}]")
                                  for j, c in enumerate(self.array(n.get("collectives", []), f"{f}.collectives"))),
                fallback=self.boolean(n.get("fallback", False), f"{f}.fallback")))
        return out

    def collective(self, c: Any, f: str) -> Collective:
        self.check_dict(c, f)
        self.fields(c, f, Collective)
        return Collective(self.string(c["kind"], f"{f}.kind"), self.choice(c["phase"], f"{f}.phase", _PHASES),
                          self.string(c["tensor"], f"{f}.tensor"), self.number(c["seconds"], f"{f}.seconds", least=0))

    def estimate(self, e: Any) -> Estimate:
        self.check_dict(e, "estimate")
        self.fields(e, "estimate", Estimate)
        tables = {x.name for x in fields(Estimate) if x.default_factory is dict}   # name -> number tables
        return Estimate(**{k: {name: self.number(v, f"estimate.{k}.{name}", least=0)
                               for name, v in self.mapping(e[k], f"estimate.{k}").items()}
                           if k in tables else self.number(e[k], f"estimate.{k}", least=0) for k in e})

    def solver(self, s: Any) -> SolverInfo:
        self.check_dict(s, "solver")
        self.fields(s, "solver", SolverInfo)
        return SolverInfo(
            solver=self.string(s["solver"], "solver.solver"), status=self.string(s["status"], "solver.status"),
            **{k: self.integer(s[k], f"solver.{k}", least=0) for k in s if k.startswith("n_")},
            objective_s=self.number(s["objective_s"], "solver.objective_s"),
            gap=self.number(s.get("gap", 0.0), "solver.gap", least=0),
            capture=self.string(s.get("capture", ""), "solver.capture"))

    def scaling(self, sc: Any) -> Scaling:
        if sc is None:
            return Scaling(unavailable="not in this saved plan: re-plan to get it")
        self.check_dict(sc, "scaling")
        self.fields(sc, "scaling", Scaling)
        seq = sc.get("seq")
        return Scaling(
            batch=self.integer(sc.get("batch", 0), "scaling.batch", least=0),
            seq=None if seq is None else self.integer(seq, "scaling.seq", least=1),
            fixed=tuple(self.choice(x, f"scaling.fixed[{i}]", _FIXED)
                        for i, x in enumerate(self.array(sc.get("fixed", []), "scaling.fixed"))),
            **{k: self.expr(sc.get(k, "0"), f"scaling.{k}") for k in ("compute_s", "comm_s", "other_s", "state_bytes")},
            memory_points=tuple(self.expr(x, f"scaling.memory_points[{i}]")
                                for i, x in enumerate(self.array(sc.get("memory_points", []), "scaling.memory_points"))),
            divisible=tuple(self.divisible(x, f"scaling.divisible[{i}]")
                            for i, x in enumerate(self.array(sc.get("divisible", []), "scaling.divisible"))),
            comm_bytes_per_axis={self.choice(k, "scaling.comm_bytes_per_axis", self.axis_names):
                                 self.expr(v, f"scaling.comm_bytes_per_axis.{k}")
                                 for k, v in self.mapping(sc.get("comm_bytes_per_axis", {}),
                                                          "scaling.comm_bytes_per_axis").items()},
            memory_budget=self.number(sc.get("memory_budget", 0.0), "scaling.memory_budget", least=0),
            unavailable=self.string(sc.get("unavailable", ""), "scaling.unavailable"))

    def divisible(self, x: Any, f: str) -> tuple[str, int]:
        pair = self.array(x, f)
        if len(pair) != 2:
            self.fail(f, f"expected [size expression, parts], got {x!r:.80}")
        return self.expr(pair[0], f"{f}[0]"), self.integer(pair[1], f"{f}[1]", least=1)

    def modes(self, d: Any, f: str, allowed: tuple[str, ...]) -> dict[str, str]:
        return {k: self.choice(v, f"{f}.{k}", allowed) for k, v in self.mapping(d, f).items()}

    def offload(self, d: Any) -> dict[str, str]:
        out = self.modes(d, "offload", TIERS)
        for k in out:
            kind, sep, what = k.partition(":")
            if not sep or kind not in OFFLOAD_CLASSES or not what:
                self.fail(f"offload.{k}", f"a key is '<class>:<layer or parameter>' with class one of "
                                          f"{', '.join(OFFLOAD_CLASSES)}")
        return out

    def pipeline(self, d: Any) -> PipelinePlan:
        f = "pipeline"
        self.check_dict(d, f)
        self.fields(d, f, PipelinePlan)
        axis = d.get("axis")
        if axis is not None:
            self.choice(axis, f"{f}.axis", self.axis_names)
        p = PipelinePlan(axis=axis, stages=self.integer(d.get("stages", 1), f"{f}.stages", least=1),
                         virtual_stages=self.integer(d.get("virtual_stages", 1), f"{f}.virtual_stages", least=1),
                         microbatches=self.integer(d.get("microbatches", 1), f"{f}.microbatches", least=1),
                         schedule=self.choice(d.get("schedule", "1f1b"), f"{f}.schedule", PIPELINE_SCHEDULES),
                         boundaries=tuple(self.string(b, f"{f}.boundaries[{i}]") for i, b in
                                          enumerate(self.array(d.get("boundaries", []), f"{f}.boundaries"))))
        if p.stages > 1 and axis is None:
            self.fail(f"{f}.axis", f"{p.stages} stages need a mesh axis")
        if p.stages > 1 and len(p.boundaries) != p.chunks:
            self.fail(f"{f}.boundaries", f"{len(p.boundaries)} boundaries for {p.chunks} chunks "
                                         f"(stages x virtual_stages)")
        return p

    # -- values -------------------------------------------------------------------------
    def pin(self, v: Any, f: str) -> tuple[str, ...]:
        """A pin: per mesh axis a placement or a strategy label."""
        items = self.array(v, f)
        if len(items) != self.naxes:
            self.fail(f, f"pin {v!r:.80} has {len(items)} entries for a mesh of {self.naxes} axes")
        try:
            parse_pin([self.string(p, f"{f}[{i}]") for i, p in enumerate(items)])
        except ValueError as e:
            self.fail(f, str(e))
        return tuple(items)

    def layout(self, v: Any, f: str) -> tuple[str, ...]:
        items = self.array(v, f)
        if len(items) != self.naxes:
            self.fail(f, f"layout {v!r:.80} has {len(items)} placements for a mesh of {self.naxes} axes "
                         f"({', '.join(self.axis_names)})")
        for i, p in enumerate(items):
            try:
                parsed = from_str(self.string(p, f"{f}[{i}]"))
            except ValueError as e:
                self.fail(f"{f}[{i}]", str(e))
            if isinstance(parsed, Shard) and parsed.dim < 0:
                self.fail(f"{f}[{i}]", f"placement {p!r} shards a negative dim")
            if isinstance(parsed, Partial) and parsed.reduce_op not in PARTIAL_OPS:
                self.fail(f"{f}[{i}]", f"placement {p!r}: a partial is one of {', '.join(PARTIAL_OPS)}")
        return tuple(p.strip() for p in items)

    def expr(self, v: Any, f: str) -> str:
        try:
            compile_expr(v, f)
        except ExprError as e:
            raise PlanFileError(f"{self.source}: {e}; nothing in it was run (re-plan the model)") from None
        return v

    def check_dict(self, v: Any, f: str) -> None:
        if not isinstance(v, dict):
            self.fail(f, f"expected an object, got {_kind(v)}")

    def mapping(self, v: Any, f: str) -> dict:
        self.check_dict(v, f)
        for k in v:
            self.string(k, f)
        return v

    def array(self, v: Any, f: str) -> list:
        if not isinstance(v, (list, tuple)):     # a tuple: a dict made in memory (Plan.to_dict)
            self.fail(f, f"expected a list, got {_kind(v)}")
        return list(v)

    def string(self, v: Any, f: str) -> str:
        if not isinstance(v, str):
            self.fail(f, f"expected text, got {_kind(v)}")
        return v

    def boolean(self, v: Any, f: str) -> bool:
        if not isinstance(v, bool):
            self.fail(f, f"expected true or false, got {_kind(v)}")
        return v

    def number(self, v: Any, f: str, least: float | None = None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            self.fail(f, f"expected a number, got {_kind(v)}")
        if least is not None and v < least:
            self.fail(f, f"{v} is below {least}")
        return v

    def integer(self, v: Any, f: str, least: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f, f"expected an integer, got {_kind(v)}")
        return self.number(v, f, least)

    def choice(self, v: Any, f: str, allowed) -> str:
        if v not in allowed or not isinstance(v, str):
            self.fail(f, f"{v!r:.80} is not one of {', '.join(allowed)}")
        return v

    def fields(self, d: dict, f: str, cls, optional: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
        """`d` has the dataclass's fields: those without a default (and not `optional`) present, no others."""
        names = [x.name for x in fields(cls) if x.name not in skip]
        required = tuple(x.name for x in fields(cls) if x.name in names and x.default is MISSING
                         and x.default_factory is MISSING and x.name not in optional)
        self.keys(d, f, required, tuple(n for n in names if n not in required))

    def keys(self, d: dict, f: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
        missing = [k for k in required if k not in d]
        if missing:
            self.fail(f, f"missing field(s) {', '.join(missing)}")
        unknown = sorted(str(k) for k in d if k not in required and k not in optional)
        if unknown:
            self.fail(f, f"unknown field(s) {', '.join(unknown)} (known: {', '.join(required + optional)})")


def _kind(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 60 else text[:60] + '...'}"

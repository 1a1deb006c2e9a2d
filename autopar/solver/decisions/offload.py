"""Offload to host memory or disk (`Plan.offload`), per layer and tensor class.

* "activations:<layer>": the tensors the layer saves for its backward are copied out as they
  are saved and freed on the device after their last forward use, then fetched back when an op's
  backward first needs one (saved-tensor hooks). Those are the activations only the layer saves
  and the resharded copies of activations its ops keep (an input gathered or all-to-all'd for an
  op: the runtime's hooks move every saved tensor that is not a parameter's storage or a gathered
  copy that residency governs; a copy residency re-gathers is priced as freed once, and still as
  held and moved: an over-estimate of that combination). The copies are priced as the runtime makes them
  (`runtime/offload.py`): synchronously, each way, with each copy's latency (copies on a side
  stream overlapping compute are not built yet, so no overlap is assumed).
* "optimizer:<layer or parameter>": optimizer state and, in mixed precision, the fp32 master
  weights live in the tier and the optimizer step runs on the host (ZeRO-Offload): each step
  sends the gradient out and the updated parameter back over the host link and pays the
  host's optimizer rate; from disk the state is also read and written once per step. The host
  also holds every offloaded gradient in fp32 while it steps (`HOST_STEP_GRAD_ITEMSIZE`).
* "gradients:<layer or parameter>" (host only; chosen under offload="auto", a fixed setting leaves
  gradients on the device): the parameter's gradient moves to the host pool as
  it is made in the backward (`runtime/grad_offload.py`: a post-accumulate-grad hook; its reduction
  over the data axes runs alone in the backward, not in a bucket, so that it is final there) and
  comes back to the device one parameter at a time inside the optimizer step (ZeRO-Offload's
  gradient memory: the device never holds every gradient at once). Priced: the way out and back
  over the host link, synchronously (no copy stream), each with its latency, plus what reducing
  the gradient alone costs more than in a bucket; freed from the point it is made through the
  step's end; held on the host. With the optimizer also on the host the gradient comes back and
  goes out again for the host step (one family's price does not depend on another's choice).
* "parameters:<layer or parameter FQN>" (host or disk, CPU meshes; like gradients, chosen under
  offload="auto"): the stored local shards live on the host or in a memory-mapped file and come to
  the device for each use, forward and backward (`runtime/param_offload.py`; ZeRO-Infinity's
  parameter offload to CPU memory or NVMe).
The tiers' capacities are per device (`DeviceProfile.host_memory_capacity`, `disk_capacity`);
a tier with none is not offered.
"""
from __future__ import annotations

from dataclasses import replace

from ...cost_model.memory import buckets_in_flight_bytes
from ...cost_model.offload import host_step_seconds, transfer_terms
from ...plan_records import TIERS
from ..families import Cost, Expr, Families, Freed, Group, Held
from ..problem import Problem
from .common import Masked, allowed_options, edges_by, layer_groups, saved_only_in
from .recompute import activation_copies, source_replaced

HOST, DISK = 1, 2
# the host step takes each gradient in its master's dtype on the host (runtime/optimizer.py), whatever
# the tier holding the state: fp32 (MASTER_DTYPE, 4 bytes per local element) in mixed precision, the
# parameter's own dtype otherwise; all the tier's gradients at once
HOST_STEP_GRAD_ITEMSIZE = 4


def tiers_allowed(problem: Problem, setting: str) -> tuple[int, ...]:
    prof = problem.mesh.profile
    have = {0: True, HOST: prof.host_memory_capacity > 0, DISK: prof.disk_capacity > 0}
    allowed = allowed_options("offload", setting, TIERS)
    missing = [TIERS[t] for t in allowed if not have[t]]
    if setting != "auto" and missing:
        raise ValueError(f"offload={setting!r}, but device profile {prof.name!r} has no {missing[0]} tier: give "
                         f"Mesh(..., host_memory=bytes, disk=bytes) or choose another offload setting")
    return tuple(t for t in allowed if have[t])


def build(problem: Problem, setting: str, gradients: bool = True) -> Families:
    allowed = tiers_allowed(problem, setting)
    fam = Families()
    groups = layer_groups(problem)
    saved = saved_only_in(problem)
    into, masks = edges_by(problem, "dst"), Masked()
    for rep, layers in groups.members.items():
        key = f"offload:activations:{rep}"
        fam.groups.append(Group(key, "offload", TIERS, tuple(f"activations:{L}" for L in layers), allowed))
        if allowed != (0,):
            activations(problem, fam, key, rep, layers, groups, allowed, saved, (into, masks))
    params: dict[str, list[str]] = {}
    out_of = edges_by(problem, "src")
    for name, d in problem.decisions.items():
        if d.kind == "param":
            layer = problem.layer.get(name)
            params.setdefault(groups.rep[layer] if layer in groups.rep else d.fqn, []).append(name)
    for owner, names in params.items():
        key = f"offload:optimizer:{owner}"
        members = sorted({f"optimizer:{problem.layer.get(n) or problem.decisions[n].fqn}" for n in names})
        fam.groups.append(Group(key, "offload", TIERS, tuple(members), allowed))
        if allowed != (0,):
            optimizer(problem, fam, key, names, allowed)
        # gradients leave the device where the planner chooses it (offload="auto"; host only): a fixed
        # setting keeps its meaning for activations and optimizer state, and `.grad` stays where it was
        grads = (0, HOST) if setting == "auto" and HOST in allowed else (0,)
        with_grads = [n for n in names if problem.decisions[n].grad_bytes and any(problem.decisions[n].grad_bytes)]
        if gradients and with_grads:
            key = f"offload:gradients:{owner}"
            fam.groups.append(Group(key, "offload", TIERS, tuple(m.replace("optimizer:", "gradients:", 1)
                                                                 for m in members), grads))
            if grads != (0,):
                gradients_out(problem, fam, key, with_grads, out_of)
            # parameters likewise (offload="auto"; host or disk): a fixed setting leaves them on the device.
            # Offered on CPU meshes only: on CUDA the executor's backward fetch would hand the op the
            # host shard, and the gradient would accumulate on the host (runtime/param_offload.py)
            key = f"offload:parameters:{owner}"
            on_cpu = problem.mesh.profile.device_type == "cpu"
            tiers = allowed if setting == "auto" and on_cpu else (0,)
            fam.groups.append(Group(key, "offload", TIERS, tuple(m.replace("optimizer:", "parameters:", 1)
                                                                 for m in members), tiers))
            if tiers != (0,):
                parameters_out(problem, fam, key, with_grads, tiers, out_of)
    return fam


def _link(problem: Problem, tier: int):
    prof = problem.mesh.profile
    return prof.host_link if tier == HOST else prof.disk_link


def activations(problem: Problem, fam: Families, key: str, rep: str, layers, groups, allowed, saved, copies) -> None:
    """`copies`: (`edges_by(problem, "dst")`, a `Masked`) to find the resharded copies the layer's ops keep;
    the `Masked` also derives each table the terms need once (the groups' representatives share most)."""
    into, masks = copies
    live = problem.live
    gates = tuple((key, t) for t in allowed if t)
    kept = {}
    for layer in layers:
        items = saved.get(layer, [])
        for o in items:
            # fetched back when the first of its savers to run its backward needs it
            until = live.backward_of(max(live.op_pos[s] for s in live.savers[o])) - 1
            fam.freed.append(Freed(Expr(((o, tuple(problem.decisions[o].act_bytes)),)), gates, live.fwd_end[o],
                                   until, f"activation {o} of {layer}", f"act:{o}"))
        # a copy, saved by its consumer alone: fetched back when that consumer's backward needs it
        kept[layer] = activation_copies(problem, groups.nodes[layer], into, masks)
        fam.freed += [replace(f, gates=gates) for _, f in kept[layer]]
    items = saved.get(rep, [])
    held = Expr(tuple((o, tuple(problem.decisions[o].act_bytes)) for o in items))
    held = sum((f.expr for _, f in kept[rep]), held)
    count = Expr((), tuple((k, masks.ones(t, 1.0)) for k, t in (e for _, f in kept[rep] for e in f.expr.edges)))
    # an activation whose one saver keeps a resharded copy instead: the copy alone is moved
    for k in dict.fromkeys(k for k, _ in kept[rep]):
        replaced = source_replaced(problem, k, into, masks)
        if replaced is not None and replaced[0] in items:
            table = replaced[1]
            held = held + Expr((), ((k, table),)).scaled(-1.0, masks.scaled)
            count = count + Expr((), ((k, masks.ones(table, -1.0)),))
    for t in allowed:
        if t:
            per_byte, per_tensor = transfer_terms(_link(problem, t), 2.0)
            moves = (held.scaled(per_byte, masks.scaled) + Expr(const=per_tensor * len(items))
                     + count.scaled(per_tensor, masks.scaled))
            fam.costs.append(Cost(moves, (key, t), len(layers), f"offload activations of {rep} to {TIERS[t]}"))
            fam.held.append(Held(held, (key, t), TIERS[t], len(layers), f"activations of {rep}"))


def optimizer(problem: Problem, fam: Families, key: str, names, allowed) -> None:
    prof = problem.mesh.profile
    for n in names:
        d = problem.decisions[n]
        opt = Expr(((n, tuple(d.opt_bytes)),))
        # the tier also holds the fp32 weights the host steps: in mixed precision the master copy is
        # optimizer state already; otherwise a copy of the parameter (`runtime/optimizer.py`)
        held = opt if d.mixed else Expr(((n, tuple(o + g for o, g in zip(d.opt_bytes, d.grad_bytes))),))
        # while the host steps, the gradient waits there (in fp32 in mixed precision: ZeRO-Offload's buffer)
        in_transit = Expr(((n, tuple(HOST_STEP_GRAD_ITEMSIZE * e for e in d.elements) if d.mixed
                            else tuple(d.grad_bytes)),))
        fam.freed.append(Freed(opt, tuple((key, t) for t in allowed if t), -1, problem.live.step_end,
                               f"optimizer state of {d.fqn}", f"opt:{n}"))
        # gradient out, parameter back: param + grad bytes = state - optimizer part
        moved = tuple(host_step_seconds(s - o, e, prof) for s, o, e in zip(d.state_bytes, d.opt_bytes, d.elements))
        for t in allowed:
            if not t:
                continue
            step = Expr(((n, moved),), const=transfer_terms(prof.host_link, 2.0)[1])
            if t == DISK:      # the state is read and written once per step
                per_byte, per_tensor = transfer_terms(prof.disk_link, 2.0)
                step = step + opt.scaled(per_byte) + Expr(const=per_tensor)
            fam.costs.append(Cost(step, (key, t), 1.0, f"optimizer step of {d.fqn} on the host"))
            fam.held.append(Held(held, (key, t), TIERS[t], 1.0, f"optimizer state of {d.fqn}"))
            fam.held.append(Held(in_transit, (key, t), "host", 1.0, f"fp32 gradient of {d.fqn} in the host step"))


def parameters_out(problem: Problem, fam: Families, key: str, names, tiers, out_of: dict[str, list[int]]) -> None:
    """The stored local shard (state bytes less gradient and optimizer parts) lives on the host or in a
    file and is off the device from its last use in the forward to the backward of that use, and after
    the backward of its first use (`runtime/param_offload.py` fetches it per use; the backward fetches it
    again); the optimizer steps the stored copy in place. Priced: two copies in per step (forward,
    backward) over the tier's link, each with its latency, synchronously (no prefetch on a copy stream:
    the runtime copies when the op runs); from disk also the updated shard written back once per step.
    `out_of`: `edges_by(problem, "src")`."""
    live, disk = problem.live, problem.mesh.profile.disk_link
    for n in names:
        d = problem.decisions[n]
        uses = [problem.edges[k].dst_pos for k in out_of.get(n, ())]
        if not uses:
            continue
        first, last = min(uses), max(uses)
        param = Expr(((n, tuple(s - o - g for s, o, g in zip(d.state_bytes, d.opt_bytes, d.grad_bytes))),))
        gates = tuple((key, t) for t in tiers if t)
        # priced as on the device before its first use and in the optimizer step (the runtime has it off
        # the device then: an over-estimate), so that the terms are not read as optimizer state freed from
        # the step's start (after < 0) or a gradient sent out (until >= step_end) by the evaluator
        for after, until in ((last, live.backward_of(last) - 1), (live.backward_of(first), live.step_end - 1)):
            if until > after:
                fam.freed.append(Freed(param, gates, after, until, f"parameter {d.fqn}", f"param:{n}"))
        for t in tiers:
            if not t:
                continue
            per_byte, per_tensor = transfer_terms(_link(problem, t), 2.0)
            moves = param.scaled(per_byte) + Expr(const=per_tensor)
            if t == DISK:
                per_byte, per_tensor = transfer_terms(disk, 1.0)
                moves = moves + param.scaled(per_byte) + Expr(const=per_tensor)
            fam.costs.append(Cost(moves, (key, t), 1.0, f"parameter {d.fqn} from the {TIERS[t]}, forward and backward"))
            fam.held.append(Held(param, (key, t), TIERS[t], 1.0, f"parameter {d.fqn}"))


def gradients_out(problem: Problem, fam: Families, key: str, names, out_of: dict[str, list[int]]) -> None:
    """A parameter's gradient moved to the host as it is made (`out_of`: `edges_by(problem, "src")`).
    Reduced alone, it takes no place in the gradient buckets' buffers either (`memory_timeline.bucket_buffers`,
    the bucketed bytes where no layouts bucket more than the buffers' cap: then their sum is the buffers')."""
    per_byte, per_tensor = transfer_terms(problem.mesh.profile.host_link, 2.0)
    uncapped = problem.bucketable <= buckets_in_flight_bytes(float("inf"), problem.mesh.profile.grad_bucket_bytes)
    since = problem.buckets_from
    for n in names:
        d = problem.decisions[n]
        grad = Expr(((n, tuple(d.grad_bytes)),))
        fam.freed.append(Freed(grad, ((key, HOST),), problem.grad_since(n) - 1, problem.live.step_end,
                               f"gradient of {d.fqn}", f"grad:{n}"))
        synced = [k for k in out_of.get(n, ()) if problem.edges[k].sync is not None]
        alone = tuple((k, tuple(tuple(0.0 if s is None else s[2] for s in row) for row in problem.edges[k].sync))
                      for k in synced)
        if uncapped and synced:     # out of the buckets' buffers from their making to the backward's end
            bucketed = Expr((), tuple((k, tuple(tuple(0.0 if s is None else s[1] for s in row)
                                                 for row in problem.edges[k].sync)) for k in synced))
            fam.freed.append(Freed(bucketed, ((key, HOST),), since - 1, 2 * problem.live.last,
                                   f"bucket buffer of the gradient of {d.fqn}", f"bucket:{n}"))
        moves = grad.scaled(per_byte) + Expr(const=per_tensor)
        fam.costs.append(Cost(moves + Expr((), alone), (key, HOST), 1.0, f"gradient of {d.fqn} to the host and back"))
        fam.held.append(Held(grad, (key, HOST), "host", 1.0, f"gradient of {d.fqn}"))

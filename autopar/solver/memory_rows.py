"""The strategy ILP's memory rows (D), kept as one sweep over the liveness points (`ilp.py`).

Row t is the per-device memory at liveness point t, forward or backward (`cost_model.memory`), in
GiB (rows in bytes, 1e9-1e11 next to 0/1 variables, trip the solver's tolerances); the last row is
the memory after the backward. Between neighbouring points only the activations and gradients
that appear or go, the copies kept for backwards not yet run and the parameter gradients made
change, so the rows are stored as those changes (events) per point: writing every row out costs
points x row length (on Llama-3-8B over 64 devices 2,249 rows of thousands of terms, most of the
build). The solver needs few of them (they are added lazily, `StrategyILP.solve_lazy`): `rows`
writes out those asked for, replaying the events in one pass, with the same coefficients in the
same order as a full write-out; `values` prices every row at a solution from the events alone.
"""
from __future__ import annotations

import math

from ..cost_model.memory import buckets_in_flight_bytes
from .memory_timeline import backward_point_at

GIB = float(2**30)
DROP_BYTES = 1e-6         # coefficients this small (in bytes) are left out of a row (rounding residue)
ACTS, COPIES, GRADS = range(3)      # the carried parts of a row, summed in this order (temps between)


class MemoryRows:
    def __init__(self, ilp):
        p, live = ilp.p, ilp.p.live
        self.ilp = ilp
        params = [n for n, d in p.decisions.items() if d.kind == "param"]
        self.whole: dict = {}            # after the backward: every gradient exists, no activation
        ilp._node_terms(self.whole, "state_bytes", params)
        for z, n in ilp.terms.freed_throughout(live.step_end).items():   # optimizer state, gradients offloaded
            self.whole[z] = self.whole.get(z, 0.0) - n * GIB
        self.n = len(live.points)
        self._coefs: dict = {}
        self._arrays: tuple | None = None     # `values`' arrays, made at its first call
        if "memory_rows" not in ilp.shared:      # the layout columns' part: the same for every model sharing them
            ilp.shared["memory_rows"] = self._layout_part(params)
        # read only: state in the forward (no gradient yet: zero_grad sets them to None); per point, the
        # events (part, sign, ((column, bytes), ...)) in order, the (column, bytes) of copies alive only
        # there, and the bytes no column moves (the gradient buckets' buffers in the backward, where constant)
        self.state, self.events, self.temps, self.buckets, self.fixed = ilp.shared["memory_rows"]
        self.since = ilp.p.buckets_from         # the buckets' buffers exist from here on

    def _layout_part(self, params) -> tuple:
        live, ilp = self.ilp.p.live, self.ilp
        state: dict = {}
        ilp._node_terms(state, "state_bytes", params)
        ilp._node_terms(state, "grad_bytes", params, -1.0)
        buckets, fixed = self._buckets()
        events, temps = self._sweep(params)
        since = self.ilp.p.buckets_from
        return state, events, temps, buckets, [fixed if where >= since else 0.0 for where in live.positions] + [0.0]

    def __len__(self) -> int:
        return self.n + 1

    def _sweep(self, params) -> tuple[list, list]:
        p, live, ilp = self.ilp.p, self.ilp.p.live, self.ilp
        kept = sorted((e.dst_pos, k) for k, e in enumerate(p.edges) if e.keeps_copy)
        made = sorted((p.grad_since(n), n) for n in params if p.decisions[n].grad_bytes)
        temps_at: dict[int, list[int]] = {}
        for k, e in enumerate(p.edges):
            if e.temp:          # None where every entry is 0 (`edges.EdgeTable`)
                temps_at.setdefault(e.dst_pos, []).append(k)
        grad_temps_at: dict[int, list[int]] = {}      # point index -> edges (memory_timeline.backward_temps)
        for k, e in enumerate(p.edges):
            if e.grad_temp is not None and (t := backward_point_at(live, live.backward_of(e.dst_pos))) is not None:
                grad_temps_at.setdefault(t, []).append(k)
        nk = nm = 0
        events: list[list[tuple]] = []
        temps: list[list[tuple]] = []
        for t, (owned, moving, where, name) in enumerate(zip(live.point_changes, live.grad_changes, live.positions,
                                                             live.point_names)):
            ev: list[tuple] = []
            for left, joined in (owned, moving):
                ev += [(ACTS, -1.0, self._node(n, "act_bytes")) for n in sorted(left)]
                ev += [(ACTS, 1.0, self._node(n, "act_bytes")) for n in sorted(joined)]
            reach = live.mirror(where)
            while nk < len(kept) and kept[nk][0] <= reach:      # copies made in the forward ...
                ev.append((COPIES, 1.0, self._edge(kept[nk][1], "saved", ilp.copy_bytes)))
                nk += 1
            while nk > 0 and kept[nk - 1][0] > reach:          # ... and freed after their backward
                nk -= 1
                ev.append((COPIES, -1.0, self._edge(kept[nk][1], "saved", ilp.copy_bytes)))
            while where > live.last and nm < len(made) and made[nm][0] <= where:
                ev.append((GRADS, 1.0, self._node(made[nm][1], "grad_bytes")))
                nm += 1
            events.append(ev)
            temps.append([vc for k in temps_at.get(where, ()) for vc in self._edge(k, "temp", ilp.temp_bytes)]
                         + list(self._backward_temp(name) if where > live.last else ())
                         + [vc for k in grad_temps_at.get(t, ()) for vc in self._edge(k, "grad_temp", {})])
        return events, temps

    def _buckets(self) -> tuple[tuple, float]:
        """The gradient buckets' buffers at a backward point, `memory_timeline.bucket_buffers`:
        min(bucketed bytes, BUCKETS_IN_FLIGHT buckets). Where no layouts can bucket more than that
        cap, the bucketed bytes themselves ((column, bytes) of every edge's bucketed gradient);
        otherwise the cap, a constant, which is exact once the chosen layouts bucket that much
        and an upper bound below (a plan the rows admit fits)."""
        p, ilp = self.ilp.p, self.ilp
        cap = buckets_in_flight_bytes(math.inf, p.mesh.profile.grad_bucket_bytes)
        if p.bucketable > cap:
            return (), cap
        coef: dict = {}
        for k, e in enumerate(p.edges):
            if e.sync is not None:
                ilp.add_edge_terms(coef, k, [[s[1] if s is not None else 0.0 for s in row] for row in e.sync])
        return tuple(coef.items()), 0.0

    def _node(self, name: str, field: str) -> tuple:
        key = (name, field)
        if key not in self._coefs:
            vals = getattr(self.ilp.p.decisions[name], field)
            self._coefs[key] = tuple((v, vals[i]) for i, v in self.ilp.var(self.ilp.p.decisions[name].leader).items()
                                     if vals[i])
        return self._coefs[key]

    def _backward_temp(self, name: str) -> tuple:
        """(column, bytes) of the backward temporaries of the op whose backward a point is
        (`memory_timeline.backward_temps`)."""
        d = self.ilp.p.decisions.get(name)
        return self._node(name, "bwd_temp") if d is not None and d.bwd_temp else ()

    def _edge(self, k: int, field: str, named: dict) -> tuple:
        """Bytes of edge k's copy: its one column (E)/(F) where it has one (in GiB already), else its y/x terms."""
        key = (k, field)
        if key not in self._coefs:
            col = named.get(self.ilp.group_of[k])
            self._coefs[key] = (((col, GIB),) if col is not None
                                else tuple(self.ilp.edge_coefs(k, getattr(self.ilp.p.edges[k], field))))
        return self._coefs[key]

    def rows(self, points) -> dict[int, dict[int, float]]:
        """Rows of these points (indices into the timeline, `self.n` for after the backward), in GiB."""
        want = set(points)
        out: dict[int, dict[int, float]] = {}
        parts: list[dict] = [{}, {}, {}]
        freed: dict[int, int] = {}              # z -> items freed at the point
        steps: list[dict] = [{} for _ in range(self.n)]
        for t, z, n in self.ilp.terms.freed_changes(self.ilp.p.live.positions) if want else ():
            steps[t][z] = steps[t].get(z, 0) + n
        for t in range(min(self.n, max(want) + 1) if want else 0):
            for part, sign, coefs in self.events[t]:
                d = parts[part]
                for v, c in coefs:
                    d[v] = d.get(v, 0.0) + sign * c
            for z, n in steps[t].items():
                freed[z] = freed.get(z, 0) + n
                if not freed[z]:
                    del freed[z]
            if t in want:
                out[t] = self._row(t, parts, freed)
        if self.n in want:
            out[self.n] = _in_gib(self.whole)
        return out

    def _row(self, t: int, parts: list[dict], freed: dict[int, int]) -> dict[int, float]:
        temps: dict = {}
        for v, c in self.temps[t]:
            temps[v] = temps.get(v, 0.0) + c
        total = dict(self.state)
        backward = dict(self.buckets) if self.ilp.p.live.positions[t] >= self.since else {}
        for part in (parts[ACTS], parts[COPIES], temps, parts[GRADS], backward):
            for v, c in part.items():
                total[v] = total.get(v, 0.0) + c
        for z, n in freed.items():
            total[z] = total.get(z, 0.0) - n * GIB    # z is in GiB already
        return _in_gib(total)

    def values(self, x) -> list[float]:
        """Every row's left side (GiB) at column values `x`, from the events (to find violated rows):
        the events, temporaries and frees (where they change) as (point, column, coefficient) arrays,
        made once, so that pricing a solution is a few vector operations (a loop over the events took
        60 ms a call on Llama-3-8B over 64 devices)."""
        import numpy as np
        if self._arrays is None:
            self._arrays = self._as_arrays()
        (ev_t, ev_v, ev_c), (tm_t, tm_v, tm_c), (fr_t, fr_v, fr_c), state, buckets, whole, extra = self._arrays
        x = np.asarray(x, dtype=np.float64)

        def per_point(t, v, c):
            return np.bincount(t, weights=c * x[v], minlength=self.n)

        run = np.cumsum(per_point(ev_t, ev_v, ev_c))
        rows = (_dot(state, x) + run + per_point(tm_t, tm_v, tm_c) + extra[0] + _dot(buckets, x) * extra[1]) / GIB \
            - np.cumsum(per_point(fr_t, fr_v, fr_c))
        return rows.tolist() + [_dot(whole, x) / GIB]

    def _as_arrays(self) -> tuple:
        import numpy as np
        live = self.ilp.p.live
        if "memory_arrays" not in self.ilp.shared:      # the events' and temporaries': shared like them
            self.ilp.shared["memory_arrays"] = (_events(self.events),
                                                _flat((t, v, c) for t, tm in enumerate(self.temps) for v, c in tm))
        events, temps = self.ilp.shared["memory_arrays"]
        frees = _flat(self.ilp.terms.freed_changes(live.positions) if self.n else ())
        backward = np.asarray([where >= self.since for where in live.positions[:self.n]], dtype=np.float64)
        extra = (np.asarray(self.fixed[:self.n], dtype=np.float64), backward)
        return events, temps, frees, _pairs(self.state.items()), _pairs(self.buckets), _pairs(self.whole.items()), extra


def _pairs(items) -> tuple:
    """(columns, coefficients) arrays of (column, coefficient) pairs."""
    import numpy as np
    items = tuple(items)
    return (np.fromiter((v for v, _ in items), dtype=np.int64, count=len(items)),
            np.fromiter((c for _, c in items), dtype=np.float64, count=len(items)))


def _flat(triples) -> tuple:
    """(point, column, coefficient) arrays of (point, column, coefficient) triples."""
    import numpy as np
    t, v, c = zip(*triples) if (triples := list(triples)) else ((), (), ())
    return np.asarray(t, dtype=np.int64), np.asarray(v, dtype=np.int64), np.asarray(c, dtype=np.float64)


def _events(events: list) -> tuple:
    """`_flat` of the events' signed terms; an event's (column, bytes) tuple is one per node or edge,
    met at many points, so each is converted once (270k terms on Llama-3-8B over 64 devices); the points and
    signs are spread over the terms in one step, not an array per event (most events are one term long)."""
    import numpy as np
    known: dict[int, tuple] = {}
    points, signs, sizes, cols, coefs = [], [], [], [], []
    for t, ev in enumerate(events):
        for _, sign, pairs in ev:
            if not pairs:
                continue
            if id(pairs) not in known:
                known[id(pairs)] = (pairs, _pairs(pairs))     # the tuple is kept: its id stays its own
            v, c = known[id(pairs)][1]
            points.append(t)
            signs.append(sign)
            sizes.append(len(v))
            cols.append(v)
            coefs.append(c)
    if not points:
        return _flat(())
    sizes = np.asarray(sizes, dtype=np.int64)
    return (np.repeat(np.asarray(points, dtype=np.int64), sizes), np.concatenate(cols),
            np.concatenate(coefs) * np.repeat(np.asarray(signs, dtype=np.float64), sizes))


def _dot(pairs: tuple, x) -> float:
    """sum of coefficient * x[column] over (columns, coefficients) arrays."""
    v, c = pairs
    return float(c @ x[v]) if len(v) else 0.0


def _in_gib(row: dict) -> dict[int, float]:
    return {v: c / GIB for v, c in row.items() if abs(c) > DROP_BYTES}

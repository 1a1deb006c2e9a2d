"""The families' terms as ILP rows (`families.py`), without knowing which family made them.

Variables, beside the layout family's x and y (`ilp.py`):
    g[G,o]   binary, one per allowed option o of group G;  (G) sum_o g[G,o] = 1
    w[c]     >= 0, seconds of cost term c;                 (H) w[c] >= E_c(x,y) - M_c (1 - g[gate c])
    z[f]     >= 0, GiB freed by item f;                    (I) z[f] <= E_f(x,y),  (J) z[f] <= M_f sum_{gates} g
    v[h]     >= 0, GiB held in a tier by term h;           (K) v[h] >= E_h(x,y) - M_h (1 - g[gate h])
Objective: + sum_c count_c w[c]. Memory rows (D) at forward point t: - sum_{f: after_f < t <= until_f} z[f];
backward row b: the last forward row + sum_{f: back_f = b} z[f]; (L) tier[T]: sum_h count_h v[h] <= capacity_T.
E is linear in the layout choice (Expr); M is its upper bound, so (H) and (K) hold trivially when the
option is off, and (J) lets an item be freed only when one of its gates is on. A group with one
allowed option has no variables: its gates are constants. Terms that are the same function of the
same variables (a term of each copy of a linked layer) share one w, z or v, counted as often as
they occur, so linked layers keep the ILP small. Every non-default option also costs
TIE_S in the objective (not in any price): between plans of equal time the solver keeps the
defaults (a parameter is not re-gathered where re-gathering would be free but useless).
"""
from __future__ import annotations

import pulp

from .families import Expr, Gate

GIB = float(2**30)
TIE_S = 1e-12     # seconds: far below any cost the model prices (a kernel launch is ~1e-6 s)


class FamilyTerms:
    def __init__(self, ilp):
        self.ilp = ilp
        fam = ilp.p.families
        self.fam = fam
        self.g: dict[str, dict[int, pulp.LpVariable]] = {}
        self.allowed = {grp.key: grp.allowed for grp in fam.groups}
        for k, grp in enumerate(fam.groups):
            if len(grp.allowed) > 1:
                self.g[grp.key] = {o: ilp.lp.add_variable(f"g_{k}_{o}", 0, 1, cat="Binary") for o in grp.allowed}
                ilp.lp += pulp.LpAffineExpression([(v, 1.0) for v in self.g[grp.key].values()]) == 1, f"G_one_option_{k}"
        self.z: list[tuple] = []       # (Freed, z variable) for items some allowed gate can free
        shared: dict = {}
        for k, f in enumerate(fam.freed):
            key = self._signature(f.expr, f.gates)
            if key not in shared:
                shared[key] = self._freed_var(k, f)
            if shared[key] is not None:
                self.z.append((f, shared[key]))

    def gate(self, gate: Gate):
        """("off", None): not allowed; ("on", None): the group's only option; ("var", g)."""
        key, o = gate
        if o not in self.allowed[key]:
            return "off", None
        if key not in self.g:
            return "on", None
        return "var", self.g[key][o]

    def coef(self, expr: Expr, scale: float = 1.0) -> dict:
        """Coefficients of expr's variable part (x and y), times scale."""
        coef: dict = {}
        for name, vals in expr.nodes:
            d = self.ilp.p.decisions[name]
            for i, c in enumerate(vals):
                if c:
                    v = self.ilp.var(d.leader)[i]
                    coef[v] = coef.get(v, 0.0) + scale * c
        for k, table in expr.edges:
            self.ilp.add_edge_terms(coef, k, table, scale)
        return coef

    def _signature(self, expr: Expr, gates) -> tuple:
        """What a term is as a function of the ILP's variables (linked copies map to the same ones)."""
        coef = self.coef(expr)
        return (tuple(gates), round(expr.const, 6),
                tuple(sorted((v.name, round(c, 6)) for v, c in coef.items() if c)))

    def _merged(self, terms, gates_of):
        """Terms with equal signatures as (term, total count), in first-seen order."""
        merged: dict = {}
        for t in terms:
            key = self._signature(t.expr, gates_of(t))
            first, count = merged.get(key, (t, 0.0))
            merged[key] = (first, count + t.count)
        return list(merged.values())

    def _gated_lower(self, name: str, expr: Expr, gate: Gate, scale: float):
        """A variable u >= scale * expr when the gate is on (0 when off): (H) and (K)."""
        kind, g = self.gate(gate)
        bound = max(0.0, expr.bound()) * scale
        if kind == "off" or bound <= 0:
            return None
        u = self.ilp.lp.add_variable(name, 0)
        row = {u: 1.0}
        for v, c in self.coef(expr, -scale).items():
            row[v] = row.get(v, 0.0) + c
        rhs = expr.const * scale
        if kind == "var":
            row[g] = row.get(g, 0.0) - bound
            rhs -= bound
        self.ilp.lp += pulp.LpAffineExpression(list(row.items())) >= rhs, f"{name.upper()}_lower"
        return u

    def _freed_var(self, k: int, f):
        gates = [self.gate(gt) for gt in f.gates]
        if all(kind == "off" for kind, _ in gates):
            return None
        z = self.ilp.lp.add_variable(f"z_{k}", 0)
        row = {z: 1.0}
        for v, c in self.coef(f.expr, -1.0 / GIB).items():
            row[v] = row.get(v, 0.0) + c
        self.ilp.lp += pulp.LpAffineExpression(list(row.items())) <= f.expr.const / GIB, f"I_freed_{k}"
        if not any(kind == "on" for kind, _ in gates):
            bound = max(0.0, f.expr.bound()) / GIB
            cap = [(z, 1.0)] + [(g, -bound) for kind, g in gates if kind == "var"]
            self.ilp.lp += pulp.LpAffineExpression(cap) <= 0, f"J_gated_{k}"
        return z

    def objective_terms(self, coef: dict) -> None:
        for grp in self.fam.groups:
            for o, g in self.g.get(grp.key, {}).items():
                if o != grp.allowed[0]:
                    coef[g] = coef.get(g, 0.0) + TIE_S
        for k, (c, count) in enumerate(self._merged(self.fam.costs, lambda c: (c.gate,))):
            w = self._gated_lower(f"w_{k}", c.expr, c.gate, 1.0)
            if w is not None:
                coef[w] = coef.get(w, 0.0) + count

    def freed_at(self, t: int) -> dict:
        """z variable -> how many items it stands for that are freed at forward point t."""
        out: dict = {}
        for f, z in self.z:
            if f.after < t <= f.until:
                out[z] = out.get(z, 0) + 1
        return out

    def backward_rows(self, end_row: dict) -> dict[str, dict]:
        rows = {}
        for key in self.fam.backs:
            row = dict(end_row)
            for f, z in self.z:
                if f.back == key:
                    row[z] = row.get(z, 0.0) + GIB      # each item returns once: z stands for one of them
            rows[key] = row
        return rows

    def add_tiers(self, capacity: dict[str, float]) -> None:
        """(L): what the host and disk tiers hold fits their capacity per device."""
        rows: dict[str, list] = {}
        for k, (h, count) in enumerate(self._merged(self.fam.held, lambda h: (h.gate, h.tier))):
            v = self._gated_lower(f"v_{k}", h.expr, h.gate, 1.0 / GIB)
            if v is not None:
                rows.setdefault(h.tier, []).append((v, count))
        for tier, terms in rows.items():
            self.ilp.lp += pulp.LpAffineExpression(terms) <= capacity[tier] / GIB, f"L_tier_{tier}"

    def options(self) -> dict[str, int]:
        """The chosen option of every group."""
        out = {}
        for grp in self.fam.groups:
            if grp.key in self.g:
                out[grp.key] = max(self.g[grp.key], key=lambda o: self.g[grp.key][o].varValue or 0.0)
            else:
                out[grp.key] = grp.allowed[0]
        return out

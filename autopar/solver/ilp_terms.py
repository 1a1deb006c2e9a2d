"""The families' terms as ILP rows (`families.py`), without knowing which family made them.

Variables, beside the layout family's x and y (`ilp.py`):
    g[G,o]   binary, one per allowed option o of group G;  (G) sum_o g[G,o] = 1
    p[v,g]   in [0, 1], the product of a layout variable v (x or y) and an option g, exactly:
             (M) p <= v, p <= g, p >= v + g - 1
    z[f]     >= 0, GiB freed by item f;                    (I) z[f] <= E_f(x,y),  (J) z[f] <= sum_{gates} E_f(p),
             (K') z[f] <= E_f(x,y) - sum_{unless} E_f(p): not freed when an `unless` gate is on
E is linear in the layout variables (Expr) and E(p) is E with every variable v replaced by p[v,g] and
its constant by constant * g: E when the option is on, 0 when off. Objective: + sum_c count_c E_c(p).
Memory rows (D) at point t (forward or backward): - sum_{f: after_f < t <= until_f} z[f]; (L) tier[T]: sum_h count_h E_h(p) <= capacity_T. A cost term
that could be negative is clamped at 0 through a variable (H) w >= E(p), w >= 0; a cost with `unless`
gates (not paid when one is on) is w >= E(p_gate) - sum_{unless} E(p_unless), w >= 0: E when its gate
alone is on, 0 when an unless gate is on too (the same E), and 0 when its gate is off. A group with one
allowed option has no variables: its gates are constants. The products keep the LP relaxation
tight (a big-M form, z <= M g, left the solver to branch over thousands of nodes on small models). Terms that are the same function of the
same variables (a term of each copy of a linked layer) share one w, z or v, counted as often as
they occur, so linked layers keep the ILP small. Every non-default option also costs
TIE_S in the objective (not in any price): between plans of equal time the solver keeps the
defaults (a parameter is not re-gathered where re-gathering would be free but useless).
With the layouts fixed (`StrategyILP`'s `choice`: the alternation's best options for a layout choice) every
E is a number, E(choice): the terms are written with it as their constant and no layout column (the same
model, less Python to write it: on Gemma-2-9B over (8, 8) the four such models of a solve wrote 7.5k freed
items' rows each through their layout columns, 40% of the solve's CPU time), and terms of equal numbers
and gates share one variable.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping

from .families import Expr, Gate
from .mip import INF, Defined

GIB = float(2**30)
TIE_S = 1e-12     # seconds: far below any cost the model prices (a kernel launch is ~1e-6 s)


class FamilyTerms:
    def __init__(self, ilp, options: Mapping[str, int] | None = None):
        """`options` (group -> option): every group fixed at that option (no g, no products)."""
        self.ilp = ilp
        fam = ilp.p.families
        self.fam = fam
        self.g: dict[str, dict[int, int]] = {}          # group -> option -> column
        self.products: dict[tuple[int, int], int] = {}
        self.allowed = {grp.key: grp.allowed if options is None else (options[grp.key],) for grp in fam.groups}
        # the layouts fixed: leader -> the strategy its representative's one column stands for
        self.at = None if ilp.choice is None else {l: ilp.choice[r] for l, r in ilp.rep.items()}
        for grp in fam.groups:
            if len(self.allowed[grp.key]) > 1:
                self.g[grp.key] = {o: ilp.m.add_col(0, 1, integral=True) for o in grp.allowed}
                ilp.m.add_row(dict.fromkeys(self.g[grp.key].values(), 1.0), 1.0, 1.0)     # (G)
        self.z: list[tuple] = []       # (Freed, z variable) for items some allowed gate can free
        shared: dict = {}
        for k, f in enumerate(fam.freed):
            if not any(self._live(g, f.unless) for g in f.gates):     # frees nothing under these options
                continue
            key = self._signature(f.expr, (f.gates, f.until if f.unless else None, f.unless))
            if key not in shared:
                shared[key] = self._freed_var(k, f)
            if shared[key] is not None:
                self.z.append((f, shared[key]))

    def tighten(self, sets) -> None:
        """Rows that make the LP relaxation tighter (the one-choice rows times an option, as the
        reformulation-linearisation technique writes them): for each set of layout columns of which one is
        1 in a plan (a decision's x, an edge group's y) and each option g with products p[v, g] on some of
        them, sum_v p[v, g] <= g and sum_v p[v, g] + sum_{the others u} u >= g. On Llama-3-8B over (8,) at
        8 x 8192 with memory decisions they raise the joint model's LP bound from 6.2% below the best
        plan to 2.1%, leaving two fractional columns (`branch.py` then proves the plan in three LPs)."""
        if not self.products:
            return
        set_of = {v: k for k, cols in enumerate(sets) for v in cols.values()}
        by: dict = {}
        for (v, g), p in self.products.items():
            if (k := set_of.get(v)) is not None:
                by.setdefault((k, g), {})[v] = p
        m = self.ilp.m
        for (k, g), ps in by.items():
            members = list(sets[k].values())
            if len(members) < 2:
                continue
            m.add_row({**dict.fromkeys(ps.values(), 1.0), g: -1.0}, -INF, 0.0)
            m.add_row({**dict.fromkeys(ps.values(), 1.0), **{u: 1.0 for u in members if u not in ps}, g: -1.0},
                      0.0, INF)

    def gate(self, gate: Gate):
        """("off", None): not allowed; ("on", None): the group's only option; ("var", g)."""
        key, o = gate
        if o not in self.allowed[key]:
            return "off", None
        if key not in self.g:
            return "on", None
        return "var", self.g[key][o]

    def coef(self, expr: Expr, scale: float = 1.0) -> dict:
        """Coefficients of expr's variable part (x and y), times scale (1 or 1/GiB: a power of two, so
        scaling the sums is exact). Worked out once for all terms alike (`_alike`: a linked layer's
        copies) and for all models sharing the layout columns. None with the layouts fixed: the
        variable part is in `const`."""
        if self.at is not None:
            return {}
        known = self.ilp.shared.setdefault("coef", {})      # read only: the dicts are shared
        key = (self._alike(expr), scale)
        if key not in known:
            if scale != 1.0:
                known[key] = {v: scale * c for v, c in self.coef(expr).items()}
            else:
                ilp, coef = self.ilp, {}
                for name, vals in expr.nodes:
                    for i, v in ilp.var(ilp.p.decisions[name].leader).items():
                        if vals[i]:
                            coef[v] = coef.get(v, 0.0) + vals[i]
                for k, table in expr.edges:
                    ilp.add_edge_terms(coef, k, table)
                known[key] = coef
        return known[key]

    def const(self, expr: Expr) -> float:
        """expr's constant; with the layouts fixed, its value there (the variable part worked out once
        per class of terms alike, `_alike`)."""
        if self.at is None:
            return expr.const
        known = self.ilp.shared.setdefault("value", {})
        key = self._alike(expr)
        if key not in known:
            known[key] = Expr(expr.nodes, expr.edges).value(self.ilp.p, self.at)
        return expr.const + known[key]

    def _alike(self, expr: Expr) -> int:
        """The class of the terms that name the same decisions' columns (a linked layer's copies name its
        representative's) with the same values in the same order, and the same edges' columns with the
        same tables (the same sums, taken in the same order): their coefficients are the same on every
        model of the problem. Worked out once per term for all of them (`StrategyILP`'s `memo`)."""
        ilp = self.ilp
        known = ilp.memo.setdefault("alike", {})
        if id(expr) not in known:
            classes = ilp.memo.setdefault("classes", {})
            key = (tuple((ilp.rep[ilp.p.decisions[name].leader], vals) for name, vals in expr.nodes),
                   tuple((ilp.group_of[k], id(table)) for k, table in expr.edges))
            # the term and its tables are kept with it: their ids stay their own
            known[id(expr)] = (expr, classes.setdefault(key, (len(classes), expr))[0])
        return known[id(expr)][1]

    def _signature(self, expr: Expr, gates) -> tuple:
        """What a term is as a function of the ILP's variables (linked copies map to the same ones); the
        coefficients' part as a number (one per distinct sorted coefficient list). With the layouts fixed,
        its value there: terms of equal values are the same function."""
        if self.at is not None:
            return tuple(gates), self.const(expr)
        known = self.ilp.shared.setdefault("signature", {})
        coef = self.coef(expr)
        if id(coef) not in known:
            ids = self.ilp.shared.setdefault("signature_ids", {})
            sig = tuple(sorted((v, round(c, 6)) for v, c in coef.items() if c))
            known[id(coef)] = (coef, ids.setdefault(sig, len(ids)))
        return (tuple(gates), round(expr.const, 6), known[id(coef)][1])

    def _live(self, gate: Gate, unless: tuple[Gate, ...] = ()) -> bool:
        """Can a term of this gate (and `unless` gates) be nonzero under the model's allowed options?"""
        return self.gate(gate)[0] != "off" and not any(self.gate(g)[0] == "on" for g in unless)

    def _merged(self, terms, gates_of, live_of):
        """Terms with equal signatures as (term, total count), in first-seen order, those left out whose gate
        is off under the model's options or one of whose `unless` gates is on (`live_of`: a term's gate and
        `unless` gates): they add nothing (a layout model at the default options has most recomputation and
        offload terms so). With the layouts free the signatures are the same on every model sharing the
        layout columns: merged once for all of them with the same allowed options."""
        if self.at is None:
            known = self.ilp.shared.setdefault("merged", {})
            key = (id(terms), len(terms), gates_of, tuple(sorted(self.allowed.items())))
            if key not in known:
                known[key] = (terms, self._merge(terms, gates_of, live_of))    # the list is kept: its id stays its own
            return known[key][1]
        return self._merge(terms, gates_of, live_of)

    def _merge(self, terms, gates_of, live_of):
        merged: dict = {}
        for t in terms:
            if not self._live(*live_of(t)):
                continue
            key = self._signature(t.expr, gates_of(t))
            first, count = merged.get(key, (t, 0.0))
            merged[key] = (first, count + t.count)
        return list(merged.values())

    def product(self, v, g):
        """p = v * g for a layout variable v in [0, 1] and an option's binary g, linearised exactly
        (McCormick: p <= v, p <= g, p >= v + g - 1); shared by every term that needs it."""
        key = (v, g)
        if key not in self.products:
            m = self.ilp.m
            p = self.ilp.add_aux(Defined({}, product=key), hi=1.0)
            m.add_row({p: 1.0, v: -1.0}, -INF, 0.0)
            m.add_row({p: 1.0, g: -1.0}, -INF, 0.0)
            m.add_row({p: 1.0, v: -1.0, g: -1.0}, -1.0, INF)
            self.products[key] = p
        return self.products[key]

    def gated(self, expr: Expr, gate: Gate, scale: float = 1.0):
        """scale * expr when the gate is on, 0 when off, as (coefficients, constant); None when off."""
        kind, g = self.gate(gate)
        if kind == "off":
            return None
        coef, const = self.coef(expr, scale), self.const(expr)
        if kind == "on":
            return coef, const * scale
        out = {self.product(v, g): c for v, c in coef.items()}
        if const:
            out[g] = out.get(g, 0.0) + const * scale
        return out, 0.0

    def _gated_lower(self, name: str, expr: Expr, gate: Gate, scale: float, unless: tuple[Gate, ...] = ()):
        """A variable u >= scale * expr when the gate is on and no `unless` gate is, >= 0 always: (H) and
        (K). A term that cannot be negative needs no u: its gated coefficients are returned as they are."""
        terms = self.gated(expr, gate, scale)
        if terms is None or any(self.gate(g)[0] == "on" for g in unless):
            return None
        coef, const = terms
        for g in unless:
            off = self.gated(expr, g, scale)
            if off is not None:
                coef = {**coef}
                for v, c in off[0].items():
                    coef[v] = coef.get(v, 0.0) - c
                const -= off[1]
        if all(c >= 0 for c in coef.values()) and const >= 0 and self.const(expr) >= 0:
            return coef, const
        u = self.ilp.add_aux(Defined(coef, const, clamp=True))
        self.ilp.m.add_row({u: 1.0, **{v: -c for v, c in coef.items()}}, const, INF)
        return {u: 1.0}, 0.0

    def _freed_var(self, k: int, f):
        gates = [self.gate(gt) for gt in f.gates]
        unless = [self.gate(gt) for gt in f.unless]
        if all(kind == "off" for kind, _ in gates) or any(kind == "on" for kind, _ in unless):
            return None
        coef, const = self.coef(f.expr, 1.0 / GIB), self.const(f.expr) / GIB
        if self.at is not None and not const:      # frees nothing at the fixed layouts: (I) holds z at 0
            return None
        gated = not any(kind == "on" for kind, _ in gates)
        z = self.ilp.add_aux(Defined(coef, const,
                                     tuple(g for kind, g in gates if kind == "var") if gated else None, clamp=True,
                                     unless=tuple(g for kind, g in unless if kind == "var")))
        row = {z: 1.0}
        for v, c in coef.items():
            row[v] = row.get(v, 0.0) - c
        self.ilp.m.add_row(row, -INF, const)                 # (I)
        if gated:
            self.ilp.m.add_row(self._gated_sum(z, f.expr, f.gates, -1.0), -INF, 0.0)          # (J)
        if any(kind == "var" for kind, _ in unless):      # (K') z <= E - sum_unless E(p)
            self.ilp.m.add_row(self._gated_sum(dict(row), f.expr, f.unless, 1.0), -INF, const)
        return z

    def _gated_sum(self, row, expr: Expr, gates, sign: float) -> dict:
        """row + sign * sum_{gates} E(p): E where a gate is on (at most one of them is)."""
        row = {row: 1.0} if isinstance(row, int) else row
        for gt in gates:
            terms = self.gated(expr, gt, 1.0 / GIB)
            if terms is not None:
                for v, c in terms[0].items():
                    row[v] = row.get(v, 0.0) + sign * c
        return row

    def objective_terms(self, coef: dict) -> None:
        for grp in self.fam.groups:
            for o, g in self.g.get(grp.key, {}).items():
                if o != grp.allowed[0]:
                    coef[g] = coef.get(g, 0.0) + TIE_S
        for k, (c, count) in enumerate(self._merged(self.fam.costs, _cost_gates, _cost_live)):
            terms = self._gated_lower(f"w_{k}", c.expr, c.gate, 1.0, c.unless)
            if terms is not None:        # the constant of an always-on option is the same in every plan
                for v, x in terms[0].items():
                    coef[v] = coef.get(v, 0.0) + count * x

    def weights(self) -> dict[int, float]:
        """Option column -> the seconds its costs come to at most (over the layouts, times the layers they
        stand for): `branch.py` branches on fractional options first, those that move the most seconds
        before the others. On Llama-3-8B over (8,) at 8 x 8192 with memory decisions the LP relaxation
        leaves 60 columns fractional: a layer group's recomputation and re-gathering taken in equal parts
        (the `unless` cost of gathering again is then 0 in the LP) in the first and last layers, which
        moves the bound by 3e-6 when fixed, and the 30 linked layers' recomputation, which closes it; the
        most fractional column is one of the first kind (11 LPs, then HiGHS's MIP: 17 CPU s), this one
        of the second (3 LPs)."""
        out = {g: 0.0 for cols in self.g.values() for g in cols.values()}
        if not out:       # the options fixed (a layout model): nothing to branch on first
            return out
        for c, count in self._merged(self.fam.costs, _cost_gates, _cost_live):
            kind, g = self.gate(c.gate)
            if kind == "var":
                out[g] += count * abs(c.expr.bound())
        return out

    def freed_throughout(self, step_end: int) -> dict:
        """z variable -> how many items it stands for that are still freed after the backward (optimizer
        state kept off the device, gradients moved to the host)."""
        out: dict = {}
        for f, z in self.z:
            if f.until >= step_end:
                out[z] = out.get(z, 0) + 1
        return out

    def freed_changes(self, positions) -> list[tuple[int, int, int]]:
        """(point, z variable, +1 or -1): where each freed item's interval (after < position <= until)
        starts and ends among the points (at increasing `positions`, forward and backward); summed up
        to a point, how many items each z stands for are freed there."""
        out = []
        for f, z in self.z:
            lo, hi = bisect.bisect_right(positions, f.after), bisect.bisect_right(positions, f.until)
            if lo < hi:
                out.append((lo, z, 1))
                if hi < len(positions):
                    out.append((hi, z, -1))
        return out

    def add_tiers(self, capacity: dict[str, float]) -> None:
        """(L): what the host and disk tiers hold fits their capacity per device."""
        rows: dict[str, list] = {}
        consts: dict[str, float] = {}
        for k, (h, count) in enumerate(self._merged(self.fam.held, _held_gates, _held_live)):
            terms = self._gated_lower(f"v_{k}", h.expr, h.gate, 1.0 / GIB)
            if terms is not None:
                row = rows.setdefault(h.tier, {})
                for v, x in terms[0].items():
                    row[v] = row.get(v, 0.0) + count * x
                consts[h.tier] = consts.get(h.tier, 0.0) + count * terms[1]
        for tier, row in rows.items():
            self.ilp.m.add_row(row, -INF, capacity[tier] / GIB - consts.get(tier, 0.0))     # (L)

    def options(self, values) -> dict[str, int]:
        """The chosen option of every group in a solution (a value per column)."""
        out = {}
        for grp in self.fam.groups:
            if grp.key in self.g:
                out[grp.key] = max(self.g[grp.key], key=lambda o: values[self.g[grp.key][o]])
            else:
                out[grp.key] = self.allowed[grp.key][0]
        return out


def _cost_gates(c) -> tuple:
    """What a cost's gates are in its signature (`FamilyTerms._merged`)."""
    return c.gate, *c.unless


def _cost_live(c) -> tuple:
    """A cost's gate and `unless` gates (`FamilyTerms._live`)."""
    return c.gate, c.unless


def _held_live(h) -> tuple:
    """A held term's gate (`FamilyTerms._live`)."""
    return (h.gate,)


def _held_gates(h) -> tuple:
    """What a held term's gate and tier are in its signature (`FamilyTerms._merged`)."""
    return h.gate, h.tier

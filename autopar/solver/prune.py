"""Smaller layout models: subspaces of strategies where the whole model is too large to solve.

On a mesh of three or more axes every tensor has (ndim + 1)^axes layouts and every edge the
square of that in pair columns (Hugging Face Llama-3-8B on (4, 4, 4): 1.24 million columns, no LP
solved in minutes). A subspace leaves the problem's indices as they are (an `allowed` set of
strategy indices per representative leader, `StrategyILP(allowed=)`):

* `merged_axes(problem, (i, j), ...)`: the strategies that do the same on mesh axes i and j (the
  same label and placement of every tensor), i.e. the plans of the mesh with axes i and j merged
  into one of their product (and so for each group given). Its model is the size of one with an
  axis fewer per merged axis (Llama-3-8B on (4, 4, 4): a (4, 16)-sized model); `axis_merges` merges
  down to two axes. A heuristic restriction: a plan found there is a plan of the full
  problem, priced by the full problem's tables, but the full optimum may lie outside it.
* `near(problem, choice)`: the strategies within one mesh axis of a plan's, where local search
  looks for a better one.

Exact pruning by a lower bound (each representative's cheapest compute summed) was tried and
dropped: on Llama-3-8B over (4, 4, 4) the bound is 0.39 s against plans of 0.98 s, and it kept
12,411 of 12,484 strategies.
"""
from __future__ import annotations

from collections import defaultdict

from .problem import Problem

Allowed = dict[str, tuple[int, ...]]


def _groups(problem: Problem) -> dict[str, list]:
    """representative leader -> every decision that shares its variables."""
    groups: dict[str, list] = defaultdict(list)
    for d in problem.decisions.values():
        groups[problem.rep.get(d.leader, d.leader)].append(d)
    return groups


def merged_axes(problem: Problem, *groups: tuple[int, ...]) -> Allowed:
    """Per representative, the strategies whose every member has the same label and placements on
    the mesh axes of each group (a group: two axes or more, merged into one of their product); a
    representative with none (pinned otherwise) keeps all."""
    def same(s) -> bool:
        return all(s.output[i] == s.output[g[0]] and all(L[i] == L[g[0]] for L in s.inputs)
                   and (not s.labels or s.labels[i] == s.labels[g[0]]) for g in groups for i in g[1:])

    out: Allowed = {}
    for r, members in _groups(problem).items():
        own = [d for d in members if d.leader == r]
        keep = tuple(k for k in range(problem.n_choices(r)) if all(same(d.strategies[k]) for d in own))
        if keep:
            out[r] = keep
    return out


def axis_merges(problem: Problem) -> list[tuple[tuple[int, ...], ...]]:
    """The groups of mesh axes (each of more than one device) merged in the subspaces a plan is sought
    in (`merged_axes`), so that two split axes are left (each subspace's model the size of a 2-D
    mesh's): none on a mesh of fewer than three such axes (its model is small enough as it is); on
    three or more, one subspace per pair of axes, that pair merged first, then, while more than two
    groups are left, the two groups whose links are most alike (the least ratio of fastest to
    slowest: axes of one level, inside nodes or across them), then fastest (a mesh of four split
    axes, (dp, cp, ep, tp) with no pipeline: a pair and then the other two, or three axes together;
    merging one pair alone left a model of three axes, as large as the one it replaces). Pairs whose
    slower link is fastest first (then the faster link, then the axes' order): the first subspace is
    always solved (the floor), the rest while time remains (`heuristic.subspace_plan`). On Hugging
    Face Llama-3-8B over (4, 4, 4) H100 the first, the two axes inside nodes, gave the best plan of
    the three: the layers' tensor parallelism, the heaviest traffic, on the fast links."""
    axes = [a for a, n in enumerate(problem.mesh.shape) if n > 1]
    if len(axes) < 3:
        return []
    bw = [link.bandwidth for link in problem.mesh.links]

    def speed(group: tuple[int, ...]) -> tuple:
        links = [bw[a] for a in group]
        return -min(links), -max(links), len(group), group

    def alike(group: tuple[int, ...]) -> tuple:      # links most alike first (the same level), then fastest
        links = [bw[a] for a in group]
        return max(links) / min(links), -min(links), len(group), group

    pairs = sorted(((a, b) for k, a in enumerate(axes) for b in axes[k + 1:]), key=speed)
    merges: list[tuple[tuple[int, ...], ...]] = []
    for pair in pairs:
        groups = [pair] + [(a,) for a in axes if a not in pair]
        while len(groups) > 2:
            x, y = min(((x, y) for k, x in enumerate(groups) for y in groups[k + 1:]),
                       key=lambda xy: alike(tuple(sorted(xy[0] + xy[1]))))
            groups = [g for g in groups if g not in (x, y)] + [tuple(sorted(x + y))]
        merged = tuple(sorted(g for g in groups if len(g) > 1))
        if merged not in merges:
            merges.append(merged)
    return merges


def near(problem: Problem, choice: dict[str, int], axes: int = 1, views: dict | None = None) -> Allowed:
    """Per representative, the strategies that differ from `choice`'s on at most `axes` mesh axes (in
    the label or placement of some member's tensor): the neighbourhood a local search solves. `views`: a
    dict the caller keeps for the problem's later calls (each strategy's placements per axis, `_per_axis`)."""
    n, views = problem.mesh.ndim, {} if views is None else views
    out: Allowed = {}
    for r, members in _groups(problem).items():
        own = [d for d in members if d.leader == r]
        what = [_per_axis(d.strategies, n, views) for d in own]
        here = [w[choice[r]] for w in what]
        out[r] = tuple(k for k in range(problem.n_choices(r))
                       if sum(any(w[k][a] != h[a] for w, h in zip(what, here)) for a in range(n)) <= axes)
    return out


def _per_axis(strategies: list, n: int, views: dict) -> list[tuple]:
    """Per strategy, what it does on each of the `n` mesh axes (output and input placements, label), kept in
    `views` by the list's id (a decision keeps its list; a linked layer's copies share one), the list with it
    (so that its id stays its own)."""
    if id(strategies) not in views:
        views[id(strategies)] = (strategies, [tuple((s.output[a], tuple(L[a] for L in s.inputs),
                                                     s.labels[a] if s.labels else None) for a in range(n))
                                              for s in strategies])
    return views[id(strategies)][1]


# A layout model of more columns than this, on a mesh of three or more axes, is solved in subspaces
# (`heuristic.subspace_plan`): Llama-3-8B on (8, 8) has 66k and is solved whole in a few seconds;
# on (4, 4, 4), 1.24 million, where no LP finished in minutes, and each merged-axes subspace 64k.
SUBSPACE_FROM = 150_000


def layout_columns(problem: Problem) -> int:
    """The columns of the whole layout model, counted without building it: an x per representative's
    strategy, a y per pair of layout classes of each group of edges with the same ends and classes
    (`ilp.StrategyILP.add_edges`; an edge with one class on a side needs none)."""
    rep = lambda l: problem.rep.get(l, l)     # noqa: E731
    n = sum(problem.n_choices(r) for r in set(map(rep, problem.leaders)))
    seen = set()
    for e in problem.edges:
        src = rep(problem.decisions[e.src].leader)
        dst = None if e.dst == "output" else rep(problem.decisions[e.dst].leader)
        key = (src, dst, tuple(e.a_of), tuple(e.b_of))
        if src != dst and dst is not None and key not in seen:
            seen.add(key)
            a, b = len(set(e.a_of)), len(set(e.b_of))
            n += a * b if a > 1 and b > 1 else 0
    return n


def too_large(problem: Problem) -> bool:
    """Is the layout model solved in subspaces (`SUBSPACE_FROM`)? Only on three or more split axes."""
    return bool(axis_merges(problem)) and layout_columns(problem) > SUBSPACE_FROM


def floor_subspace(problem: Problem) -> Allowed | None:
    """Where a model too large to solve (`too_large`) is searched first: the first merger's
    subspace (`heuristic.subspace_plan`'s floor); None (the whole model) where it is not too large.
    The plan that needs least memory is sought there too (`solve.min_memory`): the whole min-max
    model is the size of the layout model and more (Llama-3-8B at 131,072 tokens on (8, 2, 4) H100
    grew past 6 GiB in minutes)."""
    return merged_axes(problem, *axis_merges(problem)[0]) if too_large(problem) else None

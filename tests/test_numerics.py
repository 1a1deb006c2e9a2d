"""Distributed training equals single-process training (real gloo ranks, fp32).

Loss, every gradient, and every parameter after 2 AdamW steps, on 1-, 2- and 3-axis meshes,
with the solver's own plan and with plans forced to tensor-parallel and 2-D sharding so that
every rewrite path runs.
"""
from __future__ import annotations

import fnmatch

import pytest

from dist_checks import train_and_compare

TOL = 1e-5

# Megatron tensor parallelism over axis "tp" (column then row), data parallel elsewhere.
TP_PINS_MLP = {"layers.0.*": ("R", "S(0)"), "layers.1.weight": ("R", "S(1)"), "layers.1.bias": ("R", "R"),
               # the ops themselves: batch over dp, column- then row-parallel over tp (with the test profile's
               # free links, weight pins alone leave the ops free to gather the weights)
               "linear": ("S(0)", "S(1)"), "linear_1": ("S(0)", "P")}
TP_PINS_GPT = {"blocks.*.attn.qkv.*": ("R", "S(0)"), "blocks.*.fc.*": ("R", "S(0)"),
               "blocks.*.attn.proj.weight": ("R", "S(1)"), "blocks.*.fc2.weight": ("R", "S(1)"),
               # the proj and fc2 ops themselves: batch over dp, row-parallel (partial sums) over tp (with
               # the test profile's free links, weight pins alone leave the ops free to gather the weights)
               "linear_1": ("S(0)", "P"), "linear_3": ("S(0)", "P"), "linear_5": ("S(0)", "P"),
               "linear_7": ("S(0)", "P")}
# 2-D: weights split over both axes (rows over one, columns over the other).
TWO_D_PINS_MLP = {"layers.*.weight": ("S(0)", "S(1)"), "head.weight": ("S(1)", "S(0)")}
TWO_D_PINS_GPT = {"blocks.*.fc.weight": ("S(0)", "S(1)"), "blocks.*.fc2.weight": ("S(1)", "S(0)"),
                  "blocks.*.attn.qkv.weight": ("S(0)", "S(1)")}
# 3-D: batch over dp, MLP weights split over tp x sp (column over one, rows over the other).
THREE_D_PINS_GPT = {"blocks.*.fc.weight": ("R", "S(0)", "S(1)"), "blocks.*.fc2.weight": ("R", "S(1)", "S(0)"),
                    "wte.weight": ("R", "R", "S(1)")}

# on three axes the solver's own plan runs on the MLP; the GPT's rewrite on three axes runs pinned (3-D)
CASES = [
    ("mlp", (4,), ("dp",), None),
    ("mlp", (2, 2), ("dp", "tp"), None),
    ("mlp", (2, 2, 2), ("dp", "tp", "sp"), None),
    ("mlp", (2, 2), ("dp", "tp"), TP_PINS_MLP),
    ("mlp", (2, 2), ("dp", "tp"), TWO_D_PINS_MLP),
    ("gpt", (4,), ("dp",), None),
    # the GPT with the solver's plan on (2, 2): test_batch_sharded_inputs (whole inputs: test_runtime_shapes.py)
    ("gpt", (2, 2), ("dp", "tp"), TP_PINS_GPT),
    ("gpt", (2, 2), ("dp", "tp"), TWO_D_PINS_GPT),
    ("gpt", (2, 2, 2), ("dp", "tp", "sp"), THREE_D_PINS_GPT),
    ("llama", (2, 2), ("dp", "tp"), None),
]


@pytest.mark.parametrize("name,shape,axes,pins", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{'pinned' if c[3] else 'solver'}{i}"
                              for i, c in enumerate(CASES)])
def test_matches_single_process(rank_pool, name, shape, axes, pins):
    world = 1
    for s in shape:
        world *= s
    results = rank_pool(world).run(train_and_compare, name, shape, axes, pins)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < TOL, (key, r)
    assert r["sharded_nodes"] > 0, "the plan must actually shard something"
    if pins in (TP_PINS_GPT, TP_PINS_MLP):
        assert {"column", "row"} <= set(r["labels"]), r["labels"]
        # the row-parallel partial sums made whole on the plain local tensors, no DTensor on the way
        assert "LocalReshard" in r["edges"], r["edges"]
    if pins:
        for pat, lay in pins.items():
            hits = [k for k in r["placements"] if fnmatch.fnmatchcase(k, pat)]
            assert all(r["placements"][k] == tuple(lay) for k in hits)


def test_batch_sharded_inputs(rank_pool):
    """The GPT with the solver's own plan on (2, 2), each rank given its dp slice of the batch."""
    results = rank_pool(4).run(train_and_compare, "gpt", (2, 2), ("dp", "tp"), None, ("dp",))
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < TOL, (key, results[0])
    assert results[0]["sharded_nodes"] > 0, "the plan must actually shard something"

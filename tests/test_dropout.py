"""Dropout over shards (Megatron's RNG-tracker semantics): replicas of a replicated tensor draw the
same mask, shards of a sharded tensor draw different ones, and the masks are fixed by the seed."""
from __future__ import annotations

import torch
import torch.nn as nn

import autopar
from dist_checks import LAYOUTS_ONLY

P = 0.5


class TwoDropouts(nn.Module):
    """fc1 makes all-ones (zero weight, unit bias), so its dropout's output shows the mask itself."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop1 = nn.Linear(16, 64), nn.Dropout(P)
        self.fc2, self.drop2 = nn.Linear(64, 64), nn.Dropout(P)
        nn.init.zeros_(self.fc1.weight), nn.init.ones_(self.fc1.bias)

    def forward(self, x):
        h = self.drop1(self.fc1(x))
        return h, self.drop2(self.fc2(h))


# drop1 runs on column shards (split over tp), drop2 on the whole, replicated tensor
PINS = {"fc1.weight": ("S(0)",), "fc1.bias": ("S(0)",), "fc2.weight": ("S(1)",), "fc2.bias": ("R",),
        "native_dropout": ("S(1)",), "native_dropout_1": ("R",)}


def _masks(rank, world_size, seed, reseed, per_rank=0):
    torch.manual_seed(seed + per_rank * rank)
    model = TwoDropouts()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    dmodel = autopar.autoparallelize(model, autopar.Mesh((2,), ("tp",), device="cpu"), (x,), pins=PINS, **LAYOUTS_ONLY)
    if reseed is not None:
        dmodel.manual_seed(reseed)
    layouts = {n.name: n.output for n in dmodel.plan.nodes if n.name.startswith("native_dropout")}
    steps = []
    for _ in range(2):
        h, y = dmodel(x)
        (h.sum() + y.sum()).backward()
        steps.append((h.detach() != 0, y.detach()))
    grads = {k: p.grad.full_tensor() for k, p in dmodel.named_parameters()}
    return steps, layouts, grads


def test_replicas_share_masks_shards_differ_and_the_seed_fixes_them(rank_pool):
    pool = rank_pool(2)
    (r0, r1) = pool.run(_masks, 7, None)
    steps, layouts, grads = r0
    assert layouts == {"native_dropout": ("S(1)",), "native_dropout_1": ("R",)}
    for (mask0, y0), (mask1, y1) in zip(r0[0], r1[0]):
        assert torch.equal(mask0, mask1) and torch.equal(y0, y1)        # replicas agree (the whole outputs)
        assert not torch.equal(mask0[:, :32], mask0[:, 32:])            # the two shards' masks differ
        assert 0.3 < mask0.float().mean() < 0.7                         # about 1 - p kept
        assert (y0 == 0).any() and (y0 != 0).any()
    assert not torch.equal(steps[0][0], steps[1][0])                    # a new mask every call
    assert all(torch.equal(grads[k], r1[2][k]) for k in grads)
    again = pool.run(_masks, 7, None)[0]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(steps, again[0]))
    other = pool.run(_masks, 8, None)[0]
    assert not torch.equal(steps[0][0], other[0][0][0])                 # another seed, other masks
    reseeded = pool.run(_masks, 8, 7)[0]
    assert torch.equal(reseeded[0][0][0], pool.run(_masks, 9, 7)[0][0][0][0])   # manual_seed decides


def test_ranks_seeded_per_rank_still_agree_on_replicated_masks(rank_pool):
    """Ranks seeded `s + rank` (as for their data) draw as rank 0 does: replicas still agree."""
    alike = rank_pool(2).run(_masks, 7, None)
    (r0, r1) = rank_pool(2).run(_masks, 7, None, 1)
    for (m0, y0), (m1, y1), (a0, b0) in zip(r0[0], r1[0], alike[0][0]):
        assert torch.equal(m0, m1) and torch.equal(y0, y1)
        assert torch.equal(m0, a0) and torch.equal(y0, b0)

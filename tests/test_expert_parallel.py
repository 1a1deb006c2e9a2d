"""Expert parallelism (issue 18): a Hugging Face MoE model's experts op pinned ("expert_parallel",)
on 4 CPU ranks, inputs split on the batch, trains like one process (loss, gradients, parameters
after 3 AdamW steps within 1e-4) with its token-slots dispatched and combined by all-to-all."""
from __future__ import annotations

import pytest

from dist_checks import train_and_compare

MOE_TOL = 1e-4
EP_PINS = {"moe_experts*": ("expert_parallel",)}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_expert_parallel_trains_like_one_process(rank_pool, name):
    results = rank_pool(4).run(train_and_compare, f"zoo:{name}", (4,), ("ep",), EP_PINS, ("ep",), timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < MOE_TOL, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert "expert_parallel" in r["labels"], r["labels"]
    assert "autopar.moe_experts all_to_all@ep" in r["collectives"], r["collectives"]
    assert all(r["placements"][k] != ("R",) for k in r["placements"] if ".experts." in k), r["placements"]

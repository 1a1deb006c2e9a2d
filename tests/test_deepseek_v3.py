"""DeepSeek-V3 (examples/zoo.py, small config): multi-head latent attention (its keys filled slice by slice
in place), a dense first layer, then sigmoid-routed experts with a shared expert. On 4 gloo ranks over a
(2, 2) mesh it plans with no fallback and trains like one process (loss, gradients, parameters after 2
AdamW steps within 1e-4), its experts split over "tp" and its tokens over "dp"."""
from __future__ import annotations

from dist_checks import train_and_compare

TOL = 1e-4
PINS = {"moe_experts*": ("tokens", "expert_parallel")}


def test_deepseek_v3_trains_like_one_process(rank_pool):
    results = rank_pool(4).run(train_and_compare, "zoo:deepseek_v3", (2, 2), ("dp", "tp"), PINS, ("dp", "tp"),
                               timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < TOL, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert r["fallbacks"] == [], r["fallbacks"]
    assert "autopar.moe_experts all_to_all@tp" in r["collectives"], r["collectives"]

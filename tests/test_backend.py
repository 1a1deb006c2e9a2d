"""torch.compile(model, backend=autopar.compile_backend(mesh)) runs the planned distributed program."""
from __future__ import annotations

import pytest

from dist_checks import compile_and_compare


@pytest.mark.parametrize("name,shape,axes", [("mlp", (2, 2), ("dp", "tp")), ("gpt", (4,), ("dp",))])
def test_compiled_model_matches_single_process(rank_pool, name, shape, axes):
    results = rank_pool(4).run(compile_and_compare, name, shape, axes)
    r = results[0]
    assert r["plans"] == 1, r                 # one graph, planned once, reused for every step
    assert r["sharded_nodes"] > 0, r
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-5, (key, r)

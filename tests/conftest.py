import os
import sys

import pytest

# Tests import helpers as top-level modules (`from rank_pool import ...`), and the ranks
# unpickle task functions by module name, so tests/ must be importable by name.
sys.path.insert(0, os.path.dirname(__file__))
# Models are built from local configs (examples/zoo.py): nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rank_pool import before_first_fork, get_pool, shutdown_all  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import transformers  # noqa: E402
import zoo  # noqa: E402

# The zoo's Hugging Face classes are imported here, before the rank pools fork, so every rank inherits
# them instead of importing them itself (transformers loads its model modules lazily: 3-4 CPU s a rank)
for _cls in zoo._HF_CLASSES.values():
    getattr(transformers, _cls)


def _warm_autopar():
    """Plan a small GPT once in the parent: a rank forked afterwards starts with torch.export, the
    strategies and the solver warm (a cold rank pays 2-4 CPU s more for its first plan and capture)."""
    import autopar
    from models import GPT, gpt_inputs
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    autopar.plan(model, gpt_inputs(batch=8, seq=16, vocab=64), autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"),
                 symbolic=False, progress=False)


def _import_inductor():
    """Import inductor's compiler in the parent (no thread or worker pool starts on import): a rank that
    compiles (test_backend.py's inductor check) otherwise imports it itself, 3-4 CPU s a rank."""
    import torch._inductor.compile_fx  # noqa: F401


def _import_runtime():
    """Import autopar's runtime (DistributedModule, the pipeline on torch.distributed.pipelining, the weight
    loaders) in the parent: every rank runs it, and imports it at its first autoparallelize otherwise
    (0.25 CPU s a rank, measured in a forked rank; some 30 ranks a suite)."""
    import autopar.runtime.module  # noqa: F401
    import autopar.runtime.pipeline  # noqa: F401
    import autopar.runtime.weights  # noqa: F401


before_first_fork += [_warm_autopar, _import_inductor, _import_runtime]


@pytest.fixture
def rank_pool():
    """get_pool(world_size) -> a RankPool shared by the whole session."""
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    shutdown_all()


@pytest.fixture(scope="session")
def zoo_small():
    """{name: (model, args, kwargs, Captured)} for every model of examples/zoo.py, small config,
    captured once per session (tests/test_rules.py)."""
    import warnings

    from autopar.passes.capture import capture
    out = {}
    for name in zoo.MODELS:
        model, args, kwargs, _ = zoo.build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = (model, args, kwargs, capture(model, args, kwargs))
    return out

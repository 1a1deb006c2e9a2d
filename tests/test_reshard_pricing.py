"""The cost model prices the collectives the runtime issues: for layout pairs on a (2, 2) mesh,
the runtime's reshard (`Reshard`, which the rewrite puts on every edge that changes layout) runs on 4
gloo ranks and the collectives it calls, in order and on which mesh axis, are those
`Mesh.reshard_cost` lists. Nested sharding (two axes splitting one dim) is where a per-axis count
goes wrong: (S(0), S(0)) -> (R, S(0)) is two all-gathers, not one. Two known differences on gloo: a
shard moved to another dim is priced as NCCL's all-to-all, and gloo's DTensor path gathers the whole
tensor; the runtime's reduce-scatter runs there as an all-to-all and a local sum
(`direct_reshard.reduce_scatter`).
Every pair without such a step the runtime issues itself, step by step as c10d collectives on the
local tensor (`runtime/direct_reshard.py`), not through DTensor's redistribute."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
PAIRS = [((S0, S0), (R, S0)), ((S0, S0), (R, R)), ((S0, S0), (S0, R)), ((S0, S0), (S1, S0)),
         ((S0, S0), (S0, S1)), ((P, P), (S0, S0)), ((P, P), (R, S0)), ((P, P), (S0, R)), ((P, P), (R, R)),
         ((S0, S1), (R, S0)), ((S0, S1), (R, R)), ((S0, R), (R, S0)), ((R, S0), (S0, R)), ((P, S0), (S0, S0)),
         ((S0, P), (S0, S0)), ((P, S0), (R, R)), ((S0, P), (R, S0)), ((S1, S0), (R, R)), ((R, P), (S1, R)),
         ((S0, R), (S1, R)), ((R, R), (S0, P))]
_KINDS = {"all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
          "_allgather_base_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "_reduce_scatter_base_": "reduce_scatter", "all_reduce": "all_reduce",
          "allreduce_": "all_reduce", "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all"}


def _issued(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    dm = mesh.device_mesh()
    axis_of = {dm.get_group(i).group_name: name for i, name in enumerate(("dp", "tp"))}

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket.__name__
            if op in _KINDS:
                group = next(a for a in (*args, *(kwargs or {}).values())
                             if isinstance(a, str) and a in axis_of or isinstance(a, torch.ScriptObject))
                name = group if isinstance(group, str) else torch.distributed.ProcessGroup.unbox(group).group_name
                self.seen.append(f"{_KINDS[op]}@{axis_of[name]}")
            return func(*args, **(kwargs or {}))

    redistributed = []
    dtensor_redistribute = DTensor.redistribute

    def counted(self, *args, **kwargs):
        redistributed.append(1)
        return dtensor_redistribute(self, *args, **kwargs)
    DTensor.redistribute = counted
    try:
        return [_pair(src, dst, dm, mesh, Record, redistributed) for src, dst in PAIRS]
    finally:
        DTensor.redistribute = dtensor_redistribute


def _pair(src, dst, dm, mesh, Record, redistributed):
    """(collectives issued, collectives priced, whether DTensor's redistribute ran) moving src -> dst."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autopar.runtime.reshard import reshard
    torch.manual_seed(0)
    whole = torch.randn(8, 12)
    x = distribute_tensor(whole, dm, [R if isinstance(p, Partial) else p for p in src])
    terms = 2 ** sum(isinstance(p, Partial) for p in src)
    if terms > 1:                                     # a sum of equal terms over each partial axis
        x = DTensor.from_local(x.to_local() / terms, dm, src, run_check=False)
    rec = Record()
    redistributed.clear()
    with rec:
        y = reshard(x, dst)
    via_dtensor = bool(redistributed)
    assert torch.allclose(y.full_tensor(), x.full_tensor())
    return rec.seen, mesh.reshard_cost((8, 12), 4, src, dst).collectives, via_dtensor


def test_priced_collectives_are_those_the_reshard_issues(rank_pool):
    def on_gloo(priced):        # what gloo issues for each priced kind (module docstring)
        issued = {"all_to_all": "all_gather", "reduce_scatter": "all_to_all"}
        return tuple(issued.get(kind, kind) + "@" + axis for kind, axis in (p.split("@") for p in priced))
    seen = rank_pool(4).run(_issued)[0]
    wrong = [(src, dst, issued, priced) for (src, dst), (issued, priced, _) in zip(PAIRS, seen)
             if tuple(issued) != on_gloo(priced)]
    assert not wrong, "\n".join(map(str, wrong))
    # DTensor's redistribute runs exactly the moves with a step that takes a shard to another dim
    assert [via for _, _, via in seen] == [any(p.startswith("all_to_all") for p in priced) for _, priced, _ in seen]


def _reduce_scatters(rank, world_size):
    """(exact, references left with the backend) over back-to-back runtime reduce-scatters on gloo."""
    import torch.distributed as dist

    from autopar.compat import tensor_users
    from autopar.runtime.direct_reshard import reduce_scatter
    exact, left = True, 0
    for i in range(40):
        send = torch.arange(4 * (i + 1), dtype=torch.float32) * (rank + 1)
        out = torch.empty(2 * (i + 1))
        before = tensor_users(send)
        reduce_scatter(out, send, dist.group.WORLD)
        left += tensor_users(send) != before
        exact &= torch.equal(out, 3 * torch.arange(4 * (i + 1), dtype=torch.float32).chunk(2)[rank])
    return exact, left


def test_a_reduce_scatter_returns_with_its_buffers_back_on_the_calling_thread(rank_pool):
    """Gloo's worker thread drops a finished exchange's tensors a moment after it wakes the waiter; the
    runtime's reduce-scatter returns only once it has, so its buffers are freed where their last reference
    goes (a gradient bucket's, after its wait), not later on the worker's."""
    assert rank_pool(2).run(_reduce_scatters) == [(True, 0), (True, 0)]

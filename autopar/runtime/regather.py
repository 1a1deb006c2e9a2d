"""Residency: a gathered copy kept to the backward, or freed and gathered again.

Two kinds of gathered copies, one mechanism. Where a parameter's stored shard is gathered for use
(its Reshard goes from the stored layout to one with more Replicate), and where the plan says
"regather" for an activation's gather (Megatron sequence parallelism: the sequence-sharded input
of a column-parallel matmul all-gathered over the tensor-parallel axis; key "activations:<layer>"),
the rewrite's `Reshard` becomes a `GatherCopy`, which records the gathered copy's storage in a
`GatheredCopies` registry with its residency. Saved-tensor hooks (memory.py) then treat any tensor
an op saves for the backward that lives in that storage (the copy itself or a view, such as the
transposed weight a matmul saves):

* "keep": saved as is; the copy lives from the forward to the backward;
* "regather": `RegatheredCopy` keeps only the shard (the parameter itself, or the activation's
  pre-gather shard), the target layout and the view's geometry; the gathered copy is freed once
  the forward no longer uses it, and unpacking in the backward gathers it again (FSDP's
  `reshard_after_forward`, ZeRO-3; Megatron-SP's all-gather of the saved input in the backward).

Why saved-tensor hooks rather than wrapping each consuming op: the gathered copy reaches the ops
that save it through views made by other ops (a transpose, a split), so the consumer that saves it
is not always the Reshard's direct user; matching saved tensors by storage finds every such view,
whatever op saves it, with one mechanism torch already runs for every saved tensor. The gather in
the backward is the same collective as in the forward (the same DTensor redistribution), so the
unpacked copy is bit-identical to the forward's. Collectives run in autograd's order, which is the
same on every rank.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..compat import dtensor_from, local_tensor
from ..placement import layout_str
from .reshard import reshard, to_layout


@dataclass(frozen=True, slots=True)
class Regather:
    """How a `GatherCopy`'s copy is gathered again: its shard moved to the target layout."""
    shard: DTensor
    layout: tuple[Placement, ...]

    def load(self) -> torch.Tensor:
        with torch.no_grad():
            return to_layout(self.shard, self.layout).to_local()


@dataclass(frozen=True, slots=True)
class RegatheredCopy:
    """A saved view of a freed gathered copy: gathered again (`source.load()`: a `Regather`, or a
    layer's `layer_gather.LayerCopy`), and viewed again, on unpack."""
    source: object
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def load(self) -> torch.Tensor:
        return self.source.load().as_strided(self.size, self.stride, self.offset)


@dataclass(frozen=True, slots=True)
class RegatheredDTensor:
    """A DTensor view of a freed gathered copy (a recomputed layer's input that checkpoint saves: the
    layer's gathered parameters, `runtime/checkpoint.py`): its local `RegatheredCopy` gathered again on
    unpack, as the same DTensor."""
    local: RegatheredCopy
    mesh: object
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def load(self) -> torch.Tensor:
        return dtensor_from(self.local.load(), self.mesh, self.placements, shape=self.shape, stride=self.stride)


class GatheredCopies:
    """Storages of this step's gathered copies -> (how to gather again, residency).

    Entries leave when their storage is freed (a finalizer), so a storage address is never
    mistaken for a later tensor's."""

    def __init__(self):
        self._live: dict[int, tuple[object, str]] = {}

    def add(self, gathered: DTensor, shard: DTensor, layout: tuple[Placement, ...], residency: str) -> None:
        ptr = gathered.to_local().untyped_storage().data_ptr()
        if ptr == shard.to_local().untyped_storage().data_ptr() or ptr in self._live:
            return
        fetched = self._live.get(shard.to_local().untyped_storage().data_ptr())
        if fetched is not None and fetched[1] == "regather" and isinstance(fetched[0], Regather) \
                and fetched[0].layout == tuple(shard.placements):
            shard = fetched[0].shard          # a host parameter's device copy (param_offload.py): gather from the host
        self._record(gathered.to_local(), Regather(shard.detach(), layout), residency)

    def add_layer(self, buf: torch.Tensor, source) -> None:
        """A layer's flat gathered buffer (layer_gather.py), regathered by `source`."""
        self._record(buf, source, "regather")

    def _record(self, t: torch.Tensor, source, residency: str) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        self._live[ptr] = (source, residency)
        weakref.finalize(storage, self._live.pop, ptr, None)

    def pack(self, t: torch.Tensor) -> RegatheredCopy | torch.Tensor | None:
        """A saved tensor in a gathered copy: itself ("keep") or a `RegatheredCopy` ("regather");
        None if it is not in one."""
        hit = self._live.get(t.untyped_storage().data_ptr())
        if hit is None:
            return None
        source, residency = hit
        if residency == "keep":
            return t
        return RegatheredCopy(source, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def pack_dtensor(self, t: DTensor) -> RegatheredDTensor | DTensor:
        """A DTensor whose local tensor is in a re-gathered copy: a `RegatheredDTensor`; else itself (a
        parameter, or a DTensor that lives anyway)."""
        hit = self.pack(local_tensor(t))
        if not isinstance(hit, RegatheredCopy):
            return t
        return RegatheredDTensor(hit, t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()))

    def __len__(self) -> int:
        return len(self._live)


class GatherCopy(torch.nn.Module):
    """Graph op: `w = self.reshard_x(p_w)` gathering a parameter, or an activation the plan re-gathers,
    recorded in `copies` (see module docstring). Differentiates as `Reshard`
    (the gradient goes back to the source layout). `key`: the plan's residency key (a parameter FQN,
    "activations:<layer>")."""

    def __init__(self, layout: Sequence[Placement], key: str, residency: str, copies: GatheredCopies):
        super().__init__()
        self.layout, self.key, self.residency = tuple(layout), key, residency
        self._copies = [copies]          # in a list: not a submodule, not a parameter
        self.sync = None                 # the Reshard's link to the gradient buckets, if any

    def forward(self, x: DTensor) -> DTensor:
        y = reshard(x, self.layout, self.sync)
        self._copies[0].add(y, x, self.layout, self.residency)
        return y

    def extra_repr(self) -> str:
        return f"{self.key} -> {', '.join(layout_str(self.layout))}, {self.residency}"

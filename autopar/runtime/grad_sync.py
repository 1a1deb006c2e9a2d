"""Gradient synchronisation as DDP and FSDP2 run it: flat buckets, each reduced asynchronously as
soon as its gradients are ready in the backward, all waited once when the backward ends.

A parameter's gradient leaves the ops that use it partial over the mesh axes their work splits
(a weight under data parallelism is a partial sum over "dp"); the `Reshard` on the parameter's
edge (the rewrite puts one after every parameter) is where it must become the parameter's stored
layout again. Without this module each such Reshard all-reduces (or reduce-scatters) its own
gradient inside the backward, one blocking collective per parameter and use. With it:

* the Reshard's backward hands the local partial gradient to `GradSync.take`, which sums the
  parameter's uses (a tied weight has two) and, once the last expected use has arrived, copies it
  into the open bucket of its kind: the same reduction (all-reduce over a set of axes, or a
  reduce-scatter over one axis on one dim) and dtype. An all-reduce bucket filled as in the last
  backward is a `_Layout` from then on, DDP's bucket: one buffer kept from step to step, each
  gradient copied into its place in it as it arrives (no concatenation at the launch), launched
  when its last member has arrived, and after the wait each parameter's `.grad` is a DTensor over
  its place, made once (no Python per parameter but the copy and the `.grad` assignment). The
  buffer is written again only when nothing outside autopar holds it any more (every `.grad` of
  its members None, as `zero_grad()` leaves them, and no other view of it alive); else the step
  takes a new one. Where every member of such a layout is a parameter fed to the program as an
  autograd leaf (trim_wrappers.py: every weight of data parallelism), its gradients are views into
  the buffer (DDP's `gradient_as_bucket_view`): from the next forward each leaf's `.grad` is its
  place, zeroed as a backward starts, and autograd's own accumulation (C++) adds the gradient there,
  so no copy and no Python per gradient; the member that arrived last when the layout was made
  has the bucket's one Python hook, which launches it once all members have arrived (the others'
  hooks only record their arrival: a list's append, called from C++). A backward that does not
  reach that member (another output) launches it at its end, with the members it reached. A bucket
  of `bucket_bytes` or more is
  launched at once (`async_op=True`): it travels while the backward goes on. As DDP's, the first
  bucket of each kind is small (`cost_model.comm.first_bucket_bytes`, 1 MiB): the last layers'
  gradients leave early in the backward. A bucket keeps no reference to a gradient it has copied
  in: the copy is the only one. A reduce-scatter's whole-size input is freed once it is done, and
  the oldest is waited (its gradients written) when more than `REDUCE_SCATTERS_IN_FLIGHT` are out,
  as FSDP2 bounds its reduce-scatters: the unreduced gradients of a sharded model never pile up to
  the end of the backward (`cost_model.memory.BUCKETS_IN_FLIGHT` prices what the buckets hold);
* at the end of the backward (`compat.at_backward_end`, the callback DDP and FSDP2 use) the open
  buckets and any parameter whose uses did not all arrive are launched, every bucket is waited in
  launch order, and each parameter's `.grad` becomes a view of its bucket's reduced buffer (a
  `.grad` already there is added into that view first: gradient accumulation works as in eager
  PyTorch, and the buffer never holds a dead copy beside the old `.grad`).

Buckets fill in the order gradients become ready, which is the same on every rank (the same graph
runs on every rank, and autograd orders its work the same way), so every rank issues the same
collectives in the same order. Gradients whose reduction is anything else (an all-gather, an uneven
shard, a reduce-scatter together with an all-reduce) take the Reshard's own path, as do the uses of
a parameter after its bucket has left (two forwards, one backward): their reduced gradient reaches
`.grad` through autograd, and the bucket's part is added to it, so the sum is always complete.

Why our own and not DDP's Reducer or FSDP2's: both take an `nn.Module`'s plain or FSDP-sharded
parameters and reduce every gradient over one process group; here parameters are DTensor shards of
one plan whose gradients need different reductions over different mesh axes, and the reduction
must start from the local partial gradients the plan's ops produce. `torch.autograd.grad` on the
parameters sees no gradient for bucketed parameters (as with DDP): use `.backward()`.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx

from ..compat import at_backward_end, dtensor_like, parameter_table, set_group_timeout, storage_users
from ..cost_model.comm import bucketed_reduction, first_bucket_bytes
from ..placement import over_one_device
from .faults import watch_of, watched
from .direct_reshard import issue, reduce_scatter
from .reshard import Reshard

REDUCE_SCATTERS_IN_FLIGHT = 2    # launched reduce-scatter buckets not yet waited (FSDP2 keeps one or two)


@dataclass(frozen=True, slots=True)
class SyncKind:
    """How a bucket reduces: over `axes`; a reduce-scatter on `dim` (one axis), else an all-reduce."""
    axes: tuple[int, ...]
    dim: int | None
    dtype: torch.dtype

    def describe(self, names) -> str:
        what = "all_reduce" if self.dim is None else f"reduce_scatter(dim {self.dim})"
        return f"{what} over {'+'.join(str(names[a]) for a in self.axes)}"


def sync_kind(placements: tuple, stored: tuple, local: torch.Tensor, mesh_shape) -> SyncKind | None:
    """The bucketed reduction taking a gradient in `placements` (this rank's part: `local`) to the
    stored layout, or None if it has none (nothing to reduce, or a move a bucket does not do):
    `cost_model.comm.bucketed_reduction`, the rule the evaluator prices by."""
    how = bucketed_reduction(placements, stored, local.shape, mesh_shape)
    return None if how is None else SyncKind(how[0], how[1], local.dtype)


@dataclass(slots=True)
class _Bucket:
    kind: SyncKind
    names: list[str] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    # the gradients not yet copied into a flat buffer (this list holds the only references: a
    # gradient copied in is freed at once, as DDP's bucket views and FSDP2's reduce-scatter input)
    pieces: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    out: torch.Tensor | None = None
    send: torch.Tensor | None = None     # a reduce-scatter's input, kept until its wait
    work: object = None
    written: bool = False
    layout: _Layout | None = None        # a bucket laid out as the last backward's (its buffer is `out`)

    def add(self, name: str, local: torch.Tensor) -> None:
        self.names.append(name)
        self.shapes.append(local.shape)
        self.nbytes += local.numel() * local.element_size()
        self.pieces.append(local)

    def launch(self, group, n: int) -> None:
        if self.kind.dim is None:
            self.out = self.layout.flat if self.layout is not None else torch.cat([g.reshape(-1) for g in self.pieces])
            self.pieces = []
            self.work = issue(dist.all_reduce, (self.out,), group, async_op=True)
            return
        # rank r's chunks of every gradient together: [r0: g1, g2, ...][r1: ...], copied straight
        # into one buffer (no per-gradient reshape copy, no concatenation)
        total = sum(g.numel() for g in self.pieces)
        self.send = self.pieces[0].new_empty(total)
        chunks = [g.chunk(n, self.kind.dim) for g in self.pieces]
        off = 0
        for r in range(n):
            for c in chunks:
                k = c[r].numel()
                self.send[off:off + k].view(c[r].shape).copy_(c[r])
                off += k
        self.pieces = []
        self.out = self.send.new_empty(total // n)
        self.work = reduce_scatter(self.out, self.send, group, async_op=True)

    def results(self, n: int):
        """(parameter name, reduced local gradient) after the wait."""
        off = 0
        for name, shape in zip(self.names, self.shapes):
            shape = list(shape)
            if self.kind.dim is not None:
                shape[self.kind.dim] //= n
            k = math.prod(shape)
            yield name, self.out[off:off + k].view(shape)
            off += k


@dataclass(slots=True, eq=False)
class _Layout:
    """An all-reduce bucket as a backward filled it, kept for the next ones (module docstring): its
    members in order, their shapes and sizes, and while armed (in a backward) which have arrived."""
    kind: SyncKind
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    nbytes: int
    tables: tuple = ()                          # per member: (its owner's parameter table, its name there)
    flat: torch.Tensor | None = None            # the buffer, kept from step to step
    views: list[torch.Tensor] = field(default_factory=list)     # each member's place in it
    grads: list = field(default_factory=list)   # per member: (parameter, DTensor over its view) or None
    params: list = field(default_factory=list)  # this backward's parameters, by member
    got: list[bool] = field(default_factory=list)
    arrived: int = 0
    armed: bool = False                         # taking this backward's gradients
    sent: bool = False                          # launched in this backward
    leaves: tuple = ()                          # gradients as views (`GradSync.view`): each member's leaf
    arrivals: list = field(default_factory=list)    # of those, the ones accumulated in this backward

    def arm(self, params: list, like: torch.Tensor) -> None:
        """Ready for a backward: the buffer reused where nothing but its own views holds it and no
        member has a `.grad` (an accumulating step adds into a new one), else a new one."""
        self.params, self.got, self.arrived, self.armed, self.sent = params, [False] * len(params), 0, True, False
        if self.flat is not None and storage_users(self.flat) == 1 + len(self.views) \
                and all(p.grad is None for p in params) and not any(map(_held_elsewhere, self.grads)):
            return
        numels = [math.prod(s) for s in self.shapes]
        self.flat = like.new_empty(sum(numels))
        self.views = [v.view(s) for v, s in zip(self.flat.split(numels), self.shapes)]
        self.grads = [None] * len(self.names)
        for leaf, view in zip(self.leaves, self.views):     # autograd accumulates into the new places
            leaf.grad = view

    def arm_views(self, params: list) -> None:
        """`arm` before a backward of a layout whose gradients are views (`GradSync.view`): its places
        zeroed, where autograd then adds each member's gradient (the buffer it may reuse holds the
        last step's reduced gradients)."""
        self.arrivals.clear()
        self.arm(params, self.leaves[0])
        self.flat.zero_()

    def arrived_views(self) -> None:
        """After a backward's accumulations: which members arrived (`fill`'s record, in one pass)."""
        if len(self.arrivals) == len(self.leaves):
            self.got, self.arrived = [True] * len(self.leaves), len(self.leaves)
            return
        came = {id(t) for t in self.arrivals}
        self.got = [id(leaf) in came for leaf in self.leaves]
        self.arrived = sum(self.got)

    def bucket(self) -> _Bucket:
        """This backward's bucket of the layout, to launch."""
        return _Bucket(self.kind, list(self.names), list(self.shapes), nbytes=self.nbytes, layout=self)

    def fill(self, pos: int, local: torch.Tensor) -> bool:
        """Member `pos`'s gradient into its place; False: not this layout's (shape), or a second arrival."""
        view = self.views[pos]
        if self.got[pos] or self.sent or view.shape != local.shape:
            return False
        view.copy_(local)
        self.got[pos] = True
        self.arrived += 1
        return True

    def write(self) -> None:
        """After the wait: each arrived member's `.grad` is its place in the reduced buffer."""
        for k, (p, got) in enumerate(zip(self.params, self.got)):
            if not got:
                continue
            if p.grad is not None:       # a use reduced outside the bucket, or another path: added, as autograd
                write_grad(p, self.views[k], bucket=True)
                continue
            made = self.grads[k]
            if made is None or made[0] is not p:
                made = self.grads[k] = (p, dtensor_like(self.views[k], p))
            p.grad = made[1]


def _held_elsewhere(made) -> bool:
    """Is a `.grad` DTensor `_Layout` handed out (its (parameter, DTensor) entry) still referenced
    outside that entry (a caller kept `p.grad`)? Its view is the layout's own, so the storage's count
    does not tell."""
    return made is not None and sys.getrefcount(made[1]) > _OWN_REFS


_OWN_REFS = 2        # the entry's tuple and getrefcount's argument


class GradSync:
    """Per distributed module: the parameters' gradient buckets (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, device_mesh, bucket_bytes: float, deferred: bool = False):
        """deferred: a pipelined step's mode (runtime/pipeline.py): every microbatch's partial gradients
        are summed locally and nothing is launched until the caller's `finish()` after the schedule's
        last backward: one reduction per step, as the evaluator prices a pipeline's gradient sync."""
        self.module, self.mesh, self.bucket_bytes, self.deferred = module, device_mesh, bucket_bytes, deferred
        self._groups: dict[tuple[int, ...], object] = {}
        self._kinds: dict[tuple, SyncKind | None] = {}
        # parameter -> (its all-reduce bucket as a backward filled it, its place there): `_Layout`
        self._slots: dict[str, tuple[_Layout, int]] = {}
        self.buckets_launched = 0                    # this backward's (for tests and benchmarks)
        self.buckets_early = 0                       # of those, launched before the backward ended
        self.alone: frozenset[str] = frozenset()     # parameters reduced outside the buckets (grad_offload.py)
        self._owners: dict[str, tuple] | None = None  # FQN -> (submodule, attribute): `_param`
        # parameter fed as an autograd leaf (trim_wrappers.LeafParams) -> [leaf, its own hook, the hook's handle]
        self._leaves: dict[str, list] = {}
        self._viewed: list[_Layout] = []            # layouts whose gradients are views (`view`)
        self._fresh = False                         # a layout made (or left for its buffer) since the last `prepare`
        self.reset()

    def reset(self) -> None:
        """Forget a backward's state (a new forward, or the end of a backward)."""
        self._pending: dict[str, list] = {}          # name -> [kind, summed local gradient, uses arrived]
        self._open: dict[SyncKind, _Bucket] = {}
        self._sent: list[_Bucket] = []
        self._kinds_sent: set[SyncKind] = set()     # kinds whose first (small) bucket has left
        self._done: set[str] = set()
        self._armed = False
        self._ending = False
        self._params: dict | None = None            # name -> parameter, looked up once per backward
        for lay in getattr(self, "_armed_layouts", ()):
            lay.armed = False
        self._armed_layouts: list[_Layout] = []     # this backward's, in the order they were armed

    # -- gradients as views into the buckets ------------------------------------------------
    def leaf(self, name: str, leaf: torch.Tensor, hook) -> None:
        """Parameter `name` is fed as autograd leaf `leaf`, whose post-accumulate `hook` hands its
        gradient to `take`; a layout holding the parameter's last leaf goes back to those hooks."""
        old = self._leaves.get(name)
        if old is not None:
            self._unview(self._slots.get(name, (None,))[0])
            old[2].remove()
        self._leaves[name] = [leaf, hook, leaf.register_post_accumulate_grad_hook(hook)]

    def prepare(self) -> None:
        """Before a forward: every all-reduce layout whose members are all leaves and which has its
        buffer (a backward filled it as laid out: each buffer made as its bucket fills, as before, so
        a step's memory grows as priced) takes their gradients as views (`view`)."""
        if self.deferred or not self._fresh:
            return
        self._fresh = False
        for lay in {id(lay): lay for lay, _ in self._slots.values()}.values():
            if not lay.leaves and all(n in self._leaves for n in lay.names):
                if lay.flat is None:
                    self._fresh = True      # at a later forward
                else:
                    self.view(lay)

    def view(self, lay: _Layout) -> None:
        """DDP's `gradient_as_bucket_view`: each member leaf's `.grad` is its place in the layout's
        buffer, so autograd's own accumulation (C++) writes it there; no Python runs per gradient.
        The member that arrived last when the layout was made gets the one Python hook (`_viewed_in`),
        which launches the bucket if every member has arrived (the others' hooks record their
        arrival: a list's append, in C); else the backward's end does (`finish`)."""
        lay.leaves = tuple(self._leaves[n][0] for n in lay.names)
        for leaf, view in zip(lay.leaves, lay.views):      # (`arm` points them at a new buffer if it takes one)
            leaf.grad = view
        for k, name in enumerate(lay.names):
            rec = self._leaves[name]
            rec[2].remove()
            last = k == len(lay.names) - 1
            rec[2] = rec[0].register_post_accumulate_grad_hook(
                (lambda t, lay=lay: self._viewed_in(lay, t)) if last else lay.arrivals.append)
        self._viewed.append(lay)

    def _unview(self, lay: _Layout | None) -> None:
        """A layout back to its members' own hooks (a member's leaf was made anew), and forgotten."""
        if lay is None or not lay.leaves:
            return
        for name, leaf in zip(lay.names, lay.leaves):
            rec = self._leaves[name]
            if rec[0] is leaf:
                rec[2].remove()
                rec[2] = leaf.register_post_accumulate_grad_hook(rec[1])
            leaf.grad = None
        self._viewed.remove(lay)
        for name in lay.names:
            self._slots.pop(name, None)

    def _viewed_in(self, lay: _Layout, leaf: torch.Tensor) -> None:
        lay.arrivals.append(leaf)
        if not self._armed:
            at_backward_end(self.finish)
            self._armed = True
        if len(lay.arrivals) == len(lay.leaves) and not lay.sent:
            lay.arrived_views()
            self._done.update(lay.names)
            self._launch(lay.bucket())

    def watch(self, outputs) -> None:
        """Each output of a forward (a tensor, or a tuple or list of them) that autograd can
        differentiate gets a hook (`_backward_starts`) that runs in every backward through it before
        any leaf's gradient is made (the leaves are upstream of the outputs): also a forward's from
        before a layout was viewed, or one backward again (`retain_graph`)."""
        if self._leaves and not self.deferred:
            for t in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(self._backward_starts)

    def _backward_starts(self, grad) -> None:
        """A backward begins: the viewed layouts armed (their places zeroed, or new ones where the last
        gradients are still held: accumulation, a second backward of one forward), and the backward's
        end (`finish`) reduces them even where none of their last members' hooks runs."""
        if not self._armed:
            at_backward_end(self.finish)
            self._armed = True
        for lay in self._viewed:
            if not lay.armed:
                lay.arm_views([table[attr] for table, attr in lay.tables])
                self._armed_layouts.append(lay)

    # -- in the backward ---------------------------------------------------------------------
    def kind(self, placements: tuple, stored: tuple, local: torch.Tensor) -> SyncKind | None:
        """`sync_kind`, remembered: a parameter edge's layouts and shapes are the same every step."""
        key = (tuple(placements), tuple(stored), tuple(local.shape), local.dtype)
        if key not in self._kinds:      # one object per kind: a bucket's kind is matched by identity first
            made = sync_kind(*key[:2], local, self.mesh.shape)
            self._kinds[key] = next((k for k in self._kinds.values() if k == made), made)
        return self._kinds[key]

    def take(self, name: str, uses: int, kind: SyncKind | None, local: torch.Tensor) -> bool:
        """Take one of `uses` partial gradients of parameter `name` (this rank's part `local`, to be
        reduced as `kind` says) into the buckets; False: the caller reduces it itself."""
        entry = self._pending.get(name)
        if kind is None or name in self.alone or name in self._done or (entry is not None and entry[0] != kind):
            return False
        if self.deferred:
            if entry is None:
                self._pending[name] = [kind, local.clone(), 0]
            else:
                entry[1].add_(local)
            return True
        if not self._armed:
            at_backward_end(self.finish)
            self._armed = True
        if entry is None:
            if uses == 1:           # the common case (a leaf's hook: autograd summed the uses): no entry
                self._bucket(kind, name, local)
                return True
            entry = self._pending[name] = [kind, local, 0]
        else:
            entry[1] = entry[1] + local
        entry[2] += 1
        if entry[2] >= uses:
            self._ready(name)
        return True

    def _ready(self, name: str) -> None:
        kind, local, _ = self._pending.pop(name)
        self._bucket(kind, name, local)

    def _bucket(self, kind: SyncKind, name: str, local: torch.Tensor) -> None:
        """Parameter `name`'s complete local gradient into its laid-out bucket (`_Layout`), else the
        open bucket of `kind`; a bucket launched once full."""
        self._done.add(name)
        slot = self._slots.get(name)
        if slot is not None and (slot[0].kind is kind or slot[0].kind == kind):
            lay, pos = slot
            if not lay.armed:       # the members' parameters as they are now: one lookup each, no call
                lay.arm([table[attr] for table, attr in lay.tables], local)
                self._armed_layouts.append(lay)
            if lay.fill(pos, local):
                if lay.arrived == len(lay.names):
                    self._launch(lay.bucket())
                return
        b = self._open.get(kind)
        if b is None:
            b = self._open[kind] = _Bucket(kind)
        b.add(name, local)
        if b.nbytes >= (self.bucket_bytes if kind in self._kinds_sent else first_bucket_bytes(self.bucket_bytes)):
            self._launch(self._open.pop(kind))

    def _launch(self, b: _Bucket) -> None:
        axes = b.kind.axes
        watch = watch_of(self.mesh)
        if axes not in self._groups:
            self._groups[axes] = flat_group(self.mesh, axes)
            if watch is not None:       # a flattened group is new: it waits as long as the mesh's own
                set_group_timeout(self._groups[axes], watch.timeout_s)
        n = math.prod(self.mesh.size(a) for a in axes)
        with watched(self.mesh, lambda: self._what(b)):    # a peer gone at the launch: a CollectiveError too
            b.launch(self._groups[axes], n)
        self._sent.append(b)
        self._kinds_sent.add(b.kind)
        if b.layout is not None:
            b.layout.sent = True
        elif b.kind.dim is None:
            self._lay_out(b)
        self.buckets_launched += 1
        self.buckets_early += not self._ending
        # as FSDP2's: a reduce-scatter's whole-size input is freed once it is done, the oldest waited
        # when more than REDUCE_SCATTERS_IN_FLIGHT are out (memory: `cost_model.memory.buckets_in_flight_bytes`)
        scatters = [s for s in self._sent if s.kind.dim is not None and not s.written]
        for old in scatters[:max(0, len(scatters) - REDUCE_SCATTERS_IN_FLIGHT)]:
            self._complete(old)

    def _lay_out(self, b: _Bucket) -> None:
        """Keep all-reduce bucket `b` as a `_Layout` for the next backwards; a layout holding one of its
        members is dropped (the backward filled its buckets otherwise this time)."""
        for name in b.names:
            old = self._slots.get(name)
            if old is not None:
                self._unview(old[0])
                for n in old[0].names:
                    self._slots.pop(n, None)
        self._fresh = True
        lay = _Layout(b.kind, tuple(b.names), tuple(b.shapes), b.nbytes, tuple(map(self._table, b.names)))
        for k, name in enumerate(b.names):
            self._slots[name] = (lay, k)

    def write(self, name: str, local: torch.Tensor) -> None:
        """A gradient with nothing to reduce, this rank's part in the stored layout, into `.grad`."""
        if not self.deferred and not self._armed:      # forget the parameters at the backward's end
            at_backward_end(self.finish)
            self._armed = True
        with torch.no_grad():
            write_grad(self._param(name), local.contiguous())

    def _param(self, name: str) -> torch.nn.Parameter:
        """The module's parameter `name` (by FQN, aliases too), looked up once per backward in its
        owning submodule (found once: walking the module tree each backward cost more than the
        lookups), so a parameter replaced since (`load_state_dict(assign=True)`) is the one written."""
        if self._params is None:
            self._params = {}
        p = self._params.get(name)
        if p is None:
            table, attr = self._table(name)
            p = self._params[name] = table[attr]
        return p

    def _table(self, name: str) -> tuple[dict, str]:
        """(the parameter table of parameter `name`'s owning submodule, its name there)."""
        if self._owners is None:
            self._owners = {fqn: (self.module.get_submodule(fqn.rpartition(".")[0]), fqn.rpartition(".")[2])
                            for fqn, _ in self.module.named_parameters(remove_duplicate=False)}
        owner, attr = self._owners[name]
        return parameter_table(owner), attr

    def _what(self, b: _Bucket) -> str:
        names = self.mesh.mesh_dim_names or tuple(range(self.mesh.ndim))
        return f"gradient bucket: {b.kind.describe(names)} of {len(b.names)} tensors"

    def _complete(self, b: _Bucket) -> None:
        """Wait for bucket b and write its reduced gradients to `.grad`."""
        with watched(self.mesh, lambda: self._what(b)):
            b.work.wait()
        n = math.prod(self.mesh.size(a) for a in b.kind.axes)
        with torch.no_grad():
            if b.layout is not None:
                b.layout.write()
            else:
                for name, reduced in b.results(n):
                    write_grad(self._param(name), reduced, bucket=True)
        b.send, b.written = None, True

    def finish(self) -> None:
        """End of the backward: launch what is left, wait for every bucket, write `.grad`."""
        self._ending = True
        for name in list(self._pending):            # uses that never arrived (an unused output)
            self._ready(name)
        for lay in self._armed_layouts:             # members that never arrived: nothing to add
            if lay.leaves and not lay.sent:         # viewed: their places stayed zero
                lay.arrived_views()
                if lay.arrived:
                    self._launch(lay.bucket())
                continue
            if not lay.sent:
                for view, got in zip(lay.views, lay.got):
                    if not got:
                        view.zero_()
                self._launch(lay.bucket())
        for kind in list(self._open):
            self._launch(self._open.pop(kind))
        for b in self._sent:
            if not b.written:
                self._complete(b)
        self.reset()


def flat_group(device_mesh, axes: tuple[int, ...]):
    """The process group spanning mesh `axes` together at this rank's coordinates on the other axes
    (one axis: that axis's group), made by its members alone (`use_local_synchronization`, a name
    hashed from its ranks). In a pipeline only some stages reduce a gradient over several axes at
    once: a group every rank must create (DeviceMesh._flatten: every rank makes every flattened
    group) would leave the ranks' counts of groups apart, and the next group made on all ranks (a
    new DeviceMesh, a checkpoint's) would wait forever. Every member asks for the same axes in the
    same order: the members of such a group run the same stage's program. Made once per process and
    set of ranks (every module on the mesh shares it), as DeviceMesh keeps its axes' groups; a new
    default group (the job's process group made again) makes them anew."""
    if len(axes) == 1:
        return device_mesh.get_group(axes[0])
    coord = device_mesh.get_coordinate()
    index = tuple(slice(None) if a in axes else c for a, c in enumerate(coord))
    ranks = tuple(device_mesh.mesh[index].flatten().tolist())
    world, group = _FLAT_GROUPS.get(ranks, (None, None))
    if world is not dist.group.WORLD:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        _FLAT_GROUPS[ranks] = (dist.group.WORLD, group)
    return group


_FLAT_GROUPS: dict[tuple[int, ...], tuple] = {}     # ranks -> (the default group it was made in, the group)


def write_grad(p: torch.nn.Parameter, reduced: torch.Tensor, bucket: bool = False) -> None:
    """`reduced` (this rank's part, in the parameter's layout) into `p.grad`: set, or added as autograd
    would. bucket: `reduced` is a view of a bucket's reduced buffer, which other parameters' `.grad`
    views keep alive; a `.grad` already there (a tied weight's use that needed no reduction, an
    accumulated step) of the same dtype is added into that view and replaced by it, so the buffer
    holds no dead copy beside the old `.grad` (the sum is the same: IEEE addition commutes)."""
    if p.grad is None:
        p.grad = dtensor_like(reduced, p)
        return
    old = p.grad.to_local()
    if bucket and old.dtype == reduced.dtype and old.is_contiguous():
        reduced.add_(old.view_as(reduced))
        p.grad = dtensor_like(reduced, p)
    else:
        old.add_(reduced.view_as(old))


@dataclass(frozen=True, slots=True)
class ParamGrad:
    """A parameter edge's link to the module's `GradSync`: the parameter, and how many edges of the
    program use it (the partial gradients to expect per backward)."""
    sync: GradSync
    name: str
    uses: int

    def take(self, placements: tuple, stored: tuple, local: torch.Tensor) -> bool:
        """Hand over this rank's part `local` of a gradient in layout `placements`, for the parameter
        stored in `stored`; False: not bucketed, the caller reduces it itself. A gradient already in
        the stored layout, or differing from it over axes of one device alone, goes straight to
        `.grad` (nothing to reduce: no bucket, no DTensor redistribution)."""
        if self.name not in self.sync.alone and over_one_device(self.sync.mesh.shape, placements, stored):
            self.sync.write(self.name, local)
            return True
        return self.sync.take(self.name, self.uses, self.sync.kind(placements, stored, local), local)


def attach(gm: fx.GraphModule, sync: GradSync, param_of: dict[str, str]) -> None:
    """Link every Reshard on a parameter's edge in `gm` (the rewrite's program, before the memory
    executors regroup it) to `sync`. param_of: placeholder name -> parameter FQN."""
    edges = [(gm.get_submodule(n.target), param_of[n.args[0].name]) for n in gm.graph.nodes
             if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Reshard)
             and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and n.args[0].name in param_of]
    uses = Counter(fqn for _, fqn in edges)
    for mod, fqn in edges:
        mod.sync = ParamGrad(sync, fqn, uses[fqn])

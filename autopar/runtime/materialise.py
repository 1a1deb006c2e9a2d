"""A model built on the meta device, made as this rank's local shards: initialised by `init=`.

`autoparallelize(model, ..., init=FN)` gives the values of one process running

    m.to_empty(device="cpu"); m.apply(FN)          # same torch RNG state at the call

on any mesh, bitwise, while no rank holds more than one module's own parameters in full at a time.
The modules are visited in `nn.Module.apply`'s order (children first, then the module); before
`FN(module)` the module's own parameters and buffers (`recurse=False`) are made as whole CPU
tensors (empty, or the values an earlier call gave them: a tied weight seen again is gathered from
its shards), and after it each parameter keeps only this rank's slice in the plan's layout, on the
mesh's device. Every rank generates every parameter in full (the same RNG draws as the single
process), which costs each rank the single-process initialisation time and one module's
parameters of memory; nothing is communicated except to re-read a parameter an earlier call wrote.

An `FN` that also writes a submodule's tensors (Hugging Face GPT-2's `_init_weights` re-draws its
attention's `c_proj.weight`) touches a meta tensor; that call is run again from the same RNG state
with the module's whole subtree made in full, so such a module costs its subtree's parameters.

`init="reset"` is `FN = lambda m: m.reset_parameters()` for modules that have one.

Buffers are whole on every rank (as `DistributedModule` keeps them): a buffer the model holds on
a real device is taken as it is; one on meta is made by `FN` like a parameter. A checkpoint does
not hold non-persistent buffers (rotary tables): `recompute_buffers` runs the model's own code for
them (the Hugging Face model's `_init_weights`, which recomputes rotary tables, or `FN`) on those
modules alone, with their parameters left on meta and the RNG state restored after.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from ..compat import TorchDispatchMode, buffer_table, hf_init_weights, parameter_table, pytree
from ..errors import CheckpointError
from ..placement import Partial, Shard, block_index, local_shape, parse_layout

Init = Callable[[torch.nn.Module], None]


def init_function(init) -> Init | None:
    """`init=` as a function of one module: a callable, "reset" or None."""
    if init is None or callable(init):
        return init
    if init == "reset":
        return _reset
    raise CheckpointError(f"init={init!r}: give a function of one module (applied as model.apply does), "
                          f"'reset' (each module's reset_parameters()) or None")


def _reset(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def layout_of(plan, canon: str, ndim: int) -> tuple:
    return parse_layout(plan.placements.get(canon, tuple("R" for _ in range(ndim))))


def local_slices(shape, layout, device_mesh) -> tuple[slice, ...]:
    """This rank's block of a tensor of global `shape` stored in `layout` (even splits, DTensor's order
    over several axes splitting one dim)."""
    if any(isinstance(p, Partial) for p in layout):
        raise CheckpointError(f"a parameter stored as a partial sum ({layout}) has no slice of its value to load")
    coord, sizes = device_mesh.get_coordinate(), tuple(device_mesh.shape)
    part = local_shape(shape, layout, sizes)
    dims = {p.dim % len(shape) for p in layout if isinstance(p, Shard)}
    out = []
    for d, n in enumerate(shape):
        if d in dims:
            norm = [Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in layout]
            b = block_index(norm, d, coord, sizes)
            out.append(slice(b * part[d], (b + 1) * part[d]))
        else:
            out.append(slice(0, n))
    return tuple(out)


def whole(local: torch.Tensor, layout, device_mesh, shape) -> torch.Tensor:
    """The full tensor of this rank's `local` shard (a collective over the mesh when split)."""
    if not any(isinstance(p, Shard) for p in layout):
        return local
    dt = DTensor.from_local(local, device_mesh, layout, run_check=False, shape=torch.Size(shape),
                            stride=_contiguous_stride(shape))
    return dt.full_tensor()


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class _TouchedMeta(Exception):
    """FN ran an op on a meta tensor: it reaches beyond the tensors made for it."""


class _MetaWatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in pytree.tree_leaves((args, kwargs))):
            raise _TouchedMeta(str(func))
        return func(*args, **(kwargs or {}))


class Initialiser:
    """Runs `fn` over `model` in `apply` order, keeping this rank's slices (see module docstring).
    `locals[canonical parameter FQN]`: local shard on `device`; `buffers[FQN]`: whole tensor."""

    def __init__(self, model: torch.nn.Module, fn: Init, layout: Callable[[str, int], tuple], device_mesh,
                 device: torch.device, canon: Callable[[str], str]):
        self.fn, self.layout, self.mesh, self.device = fn, layout, device_mesh, device
        self.names = {id(p): canon(n) for n, p in model.named_parameters()}
        self.buffer_names = {id(b): n for n, b in model.named_buffers()}
        self.locals: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def run(self, model: torch.nn.Module) -> None:
        for child in model.children():
            self.run(child)
        state = torch.get_rng_state()
        try:
            self._call(model, recurse=False)
        except _TouchedMeta:
            torch.set_rng_state(state)
            try:
                self._call(model, recurse=True)
            except _TouchedMeta as e:
                raise CheckpointError(
                    f"init function {getattr(self.fn, '__name__', self.fn)!r} called on module "
                    f"{type(model).__name__} ran {e} on a tensor outside that module's subtree: an init "
                    f"function given to autoparallelize must write only the module it is called on and its "
                    f"submodules (as model.apply expects)") from None

    def _call(self, module: torch.nn.Module, recurse: bool) -> None:
        made = self._present(module, recurse)
        try:
            with torch.no_grad(), _MetaWatch():
                self.fn(module)
        except BaseException:
            for owner, kind, name, meta, _ in made:     # nothing kept: a retry starts from the values before
                (parameter_table(owner) if kind == "param" else buffer_table(owner))[name] = meta
            raise
        self._keep(made)

    def _present(self, module: torch.nn.Module, recurse: bool) -> list:
        """Put whole CPU tensors in place of the meta parameters and buffers `fn(module)` may write;
        -> [(owner, kind, name, meta original, made)]."""
        made = []
        owners = module.modules() if recurse else (module,)
        for owner in owners:
            for kind, table in (("param", parameter_table(owner)), ("buffer", buffer_table(owner))):
                for name, t in list(table.items()):
                    if t is None or not t.is_meta:
                        continue
                    value = self._current(t, kind)
                    table[name] = torch.nn.Parameter(value, t.requires_grad) if kind == "param" else value
                    made.append((owner, kind, name, t, table[name]))
        return made

    def _current(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """The tensor's value so far (written by an earlier call) as a whole CPU tensor, or empty."""
        if kind == "buffer":
            key = self.buffer_names[id(t)]
            return self.buffers[key].clone().cpu() if key in self.buffers else torch.empty(t.shape, dtype=t.dtype)
        key = self.names[id(t)]
        if key not in self.locals:
            return torch.empty(t.shape, dtype=t.dtype)
        return whole(self.locals[key], self.layout(key, t.ndim), self.mesh, t.shape).cpu().clone()

    def _keep(self, made: list) -> None:
        """Each made tensor -> this rank's slice (parameters) or whole (buffers); the meta original back."""
        for owner, kind, name, meta, value in made:
            table = parameter_table(owner) if kind == "param" else buffer_table(owner)
            table[name] = meta
            if kind == "buffer":
                self.buffers[self.buffer_names[id(meta)]] = value.to(self.device)
                continue
            key = self.names[id(meta)]
            piece = value.detach()[local_slices(value.shape, self.layout(key, value.ndim), self.mesh)]
            self.locals[key] = piece.to(self.device, copy=True).contiguous()


def recompute_buffers(model: torch.nn.Module, fn: Init | None, missing: set[str], device: torch.device,
                      where: str) -> dict[str, torch.Tensor]:
    """{buffer FQN: whole tensor} for the meta buffers `missing` (not in the checkpoint): `fn`, else the
    model's `_init_weights` (Hugging Face), run on the modules holding them with their parameters on
    meta (writes there are no-ops) and the RNG state restored after. A buffer neither computes ->
    CheckpointError naming it."""
    fn = fn or hf_init_weights(model)
    out: dict[str, torch.Tensor] = {}
    if not missing:
        return out
    if fn is None:
        raise CheckpointError(f"{where} holds no value for buffer {sorted(missing)[0]!r} (on the meta device), "
                              f"and the model has no _init_weights to compute it: pass init=FN that computes it, "
                              f"or build the model with its buffers off the meta device")
    for prefix, module in model.named_modules():
        mine = {n: b for n, b in buffer_table(module).items()
                if b is not None and b.is_meta and _join(prefix, n) in missing}
        if not mine:
            continue
        for n, b in mine.items():
            buffer_table(module)[n] = torch.empty(b.shape, dtype=b.dtype)
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                fn(module)
            out.update({_join(prefix, n): buffer_table(module)[n].to(device) for n in mine})
        finally:
            buffer_table(module).update(mine)
    unset = sorted(missing - set(out))
    if unset:
        raise CheckpointError(f"{where} holds no value for buffer {unset[0]!r} and nothing recomputes it")
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name

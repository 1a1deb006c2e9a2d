"""The optimizer a plan asks for: state and master weights on device, host or disk, in the plan's precision.

`plan.options["precision"]` says which parameters train in mixed precision, by the one rule the
planner prices them with (`cost_model.memory.is_mixed`): "same" keeps every copy in the parameter's
dtype (a bf16 parameter's AdamW moments in bf16: 2 + 2 gradient + 4 state bytes per parameter);
"mixed" and "auto" keep an fp32 master weight and fp32 moments for 16-bit parameters (2 + 2 + 4 + 8:
the 16 B/param of ZeRO); 32-bit parameters have no finer copy to keep and train as "same".

`dmodel.optimizer(torch.optim.AdamW, lr=1e-3)` builds one torch optimizer per place:

* "direct": parameters without a master copy (not mixed) whose optimizer tier is "device": the
  optimizer updates the parameters in place, as `torch.optim.AdamW(dmodel.parameters())` would, but
  steps their local shards (the DTensors' own storage, each given its gradient's local part for the
  step): the same arithmetic on the same shards with none of DTensor's per-op dispatch (about 8 ops
  per parameter per step); its state is plain local tensors, like the other tiers';
* "device": mixed-precision parameters on "device": an fp32 master copy of each shard on the
  device; the optimizer steps the master with the gradient cast to fp32, and the parameter receives
  the master rounded to its dtype;
* "host": the master (fp32 in mixed precision, else a copy in the parameter's dtype) and the
  optimizer state live in the module's `HostPool`; each step copies the gradient shard to the host,
  runs the optimizer there (ZeRO-Offload), and copies the updated master back into the parameter shard;
* "disk": as "host", with master and state in memory-mapped files of the module's `DiskStore`.

A gradient the plan puts on the host (`grad_offload.py`) comes back to the device for its
parameter's update; with the state on the host it is copied out again for the host step.

The tier of a parameter is `plan.offload["optimizer:<FQN>"]`, else `plan.offload["optimizer:<its
layer>"]`, else "device". torch's optimizer creates its state lazily on the first step; state it
creates for the host or disk tier is moved into the pool or a file right after that step.
`state_dict()` holds each inner optimizer's state dict and the master weights by FQN;
`load_state_dict` puts them back in their tiers.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..compat import local_tensor
from ..cost_model.memory import PRECISIONS, is_mixed
from ..errors import AutoparError
from ..passes.layers import layer_key
from ..plan_records import TIERS
from .offload import host_scope

MASTER_DTYPE = torch.float32     # the master weight of a mixed-precision parameter


@dataclass(slots=True)
class _Master:
    fqn: str
    param: torch.nn.Parameter          # the DTensor shard the model computes with
    master: torch.Tensor               # copy of its local shard in the tier (fp32 in mixed precision)


def offload_tier(offload: dict[str, str], what: str, names: list[str]) -> str:
    """The tier plan.offload gives `what` ("optimizer", "gradients") of a parameter known by `names`
    (its FQN and aliases): its own key, else its layer's, else "device"."""
    for key in [f"{what}:{n}" for n in names] + [f"{what}:{layer_key(n)}" for n in names if layer_key(n)]:
        if key in offload:
            return offload[key]
    return "device"


class PlannedOptimizer:
    """See module docstring. `step`, `zero_grad`, `state_dict`, `load_state_dict`, `param_groups`."""

    def __init__(self, module, cls: type[torch.optim.Optimizer], **kwargs):
        self.module = module
        mem = module.memory
        self._pool, self._mem = mem.pool, mem
        names: dict[int, list[str]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for fqn, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(fqn)
            params[id(p)] = p
        offload = module.optimizer_offload
        check_keys(offload, [n for ns in names.values() for n in ns])
        precision = plan_precision(module.plan)
        direct: list[torch.nn.Parameter] = []
        self._masters: dict[str, list[_Master]] = {}
        for key, p in params.items():
            tier = offload_tier(offload, "optimizer", names[key])
            mixed = is_mixed(p.dtype.itemsize, precision)
            if tier == "device" and not mixed:
                direct.append(p)
            else:
                master = self._new_master(p, tier, MASTER_DTYPE if mixed else p.dtype)
                self._masters.setdefault(tier, []).append(_Master(names[key][0], p, master))
        self._inner: dict[str, torch.optim.Optimizer] = {}
        # (parameter, the shard the optimizer steps, the local tensor the DTensor held then: None for a plain tensor)
        self._direct = [(p, _local_now(p), _held(p)) for p in direct]
        if direct:
            self._inner["direct"] = cls([local for _, local, _ in self._direct], **kwargs)
        for tier, ms in self._masters.items():
            self._inner[tier] = cls([m.master for m in ms], **kwargs)
        self._placed: set[int] = set()     # storages of state tensors already in their tier
        self._params = list(params.values())     # each once (tied ones too), for zero_grad

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self._inner.values() for g in opt.param_groups]

    def tier_of(self, fqn: str) -> str:
        for tier, ms in self._masters.items():
            if any(m.fqn == fqn for m in ms):
                return tier
        return "device"

    def master(self, fqn: str) -> torch.Tensor | None:
        """The master shard of a parameter (None for a parameter stepped in place)."""
        return next((m.master for ms in self._masters.values() for m in ms if m.fqn == fqn), None)

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(tier, tensor) for every master weight and state tensor ("direct" for state of parameters
        stepped in place), e.g. for a memory meter's baseline."""
        out = [(tier, m.master) for tier, ms in self._masters.items() for m in ms]
        for tier, opt in self._inner.items():
            out += [(tier, v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    # -- stepping ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        grads = self._mem.grads
        for tier, ms in self._masters.items():
            with host_scope() if tier != "device" else contextlib.nullcontext():
                for m in ms:
                    g = grads.back(m.param) if grads is not None and grads.has(m.param) else m.param.grad
                    m.master.grad = None if g is None else _local(g).to(m.master.device, m.master.dtype, copy=True)
                self._inner[tier].step()
                for m in ms:
                    m.master.grad = None
                self._place_state(tier)
            for m in ms:
                _local(m.param).copy_(m.master, non_blocking=self._pool.pin)
        if "direct" in self._inner:
            self._step_direct(grads)

    def _step_direct(self, grads) -> None:
        """The in-place step on local shards, in one pass over the parameters: a DTensor's shard is lent
        its gradient's local tensor as it is (no view, no autograd) and the loan ends after the step, so
        nothing but `.grad` holds a gradient bucket between steps (grad_sync.py reuses it). A gradient
        on the host (grad_offload.py) comes back for its own parameter's update only (torch's optimizers
        skip parameters without a gradient), so the device holds one of them at a time."""
        opt = self._inner["direct"]
        lent = []
        for i, (p, local, held) in enumerate(self._direct):
            if held is None:            # a plain tensor: stepped with its own `.grad`
                continue
            if local_tensor(p) is not held:
                local = self._follow(opt, i)
            g = p.grad
            if g is None:
                local.grad = None       # skipped by the step
            else:
                local.grad = local_tensor(g) if isinstance(g, DTensor) else g
                lent.append(local)
        opt.step()
        for local in lent:
            local.grad = None
        if grads is None:
            return
        for p, local, _ in self._direct:
            g = grads.back(p) if grads.has(p) else None
            if g is not None:
                local.grad = _local(g)
                opt.step()
                local.grad = None

    def _follow(self, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
        """Parameter `i` holds another local tensor object than at the last check: where its storage or
        shape changed too (`load_state_dict(assign=True)`), the optimizer steps its new shard and the
        state moves with it. Returns the shard the optimizer steps."""
        p, local, _ = self._direct[i]
        held = local_tensor(p)
        if held.data_ptr() == local.data_ptr() and held.shape == local.shape:
            self._direct[i] = (p, local, held)
            return local
        now = _local_now(p)
        if local in opt.state:
            opt.state[now] = opt.state.pop(local)
        for g in opt.param_groups:
            g["params"] = [now if q is local else q for q in g["params"]]
        self._direct[i] = (p, now, _held(p))
        return now

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._mem.grads is not None:
            self._mem.grads.clear()
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizers": {k: opt.state_dict() for k, opt in self._inner.items()},
                "master": {m.fqn: m.master for ms in self._masters.values() for m in ms}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if set(state["optimizers"]) != set(self._inner):
            raise AutoparError(f"optimizer state for {sorted(state['optimizers'])} does not fit this plan's optimizer "
                               f"placement {sorted(self._inner)}: load it into an optimizer of the same plan")
        for k, opt in self._inner.items():
            opt.load_state_dict(state["optimizers"][k])
        for ms in self._masters.values():
            for m in ms:
                m.master.copy_(state["master"][m.fqn])
        self._placed.clear()       # torch made new state tensors: place them all
        for tier in self._masters:
            self._place_state(tier)

    # -- tiers ---------------------------------------------------------------------------
    def _new_master(self, p: torch.nn.Parameter, tier: str, dtype: torch.dtype) -> torch.Tensor:
        local = _local(p).detach()
        with torch.no_grad():
            if tier == "device":
                return local.to(dtype, copy=True)
            with host_scope():
                if tier == "host":
                    return self._pool.put(local.to(dtype))
                mapped = self._mem.disk_store().mapped(tuple(local.shape), dtype)
                return mapped.copy_(local)

    def _place_state(self, tier: str) -> None:
        """Move state tensors the optimizer created into the tier (host pool / files)."""
        if tier == "device":
            return
        opt = self._inner[tier]
        for state in opt.state.values():
            for k, v in state.items():
                if not isinstance(v, torch.Tensor) or v.untyped_storage().data_ptr() in self._placed:
                    continue
                if tier == "host":
                    placed = self._pool.put(v)
                else:
                    placed = self._mem.disk_store().mapped(tuple(v.shape), v.dtype).copy_(v)
                state[k] = placed
                self._placed.add(placed.untyped_storage().data_ptr())


def plan_precision(plan) -> str:
    """The plan's `precision` option, checked (a hand-edited plan file may name anything)."""
    precision = plan.options.get("precision", "auto")
    if precision not in PRECISIONS:
        raise AutoparError(f"plan.options['precision'] = {precision!r} is not one of {PRECISIONS}: "
                           f"set it to one of them in the plan file, or plan again with autopar.plan(precision=...)")
    return precision


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held(p: torch.Tensor) -> torch.Tensor | None:
    """The local tensor object a DTensor parameter holds (`compat.local_tensor`: a step checks by identity
    that it was not replaced); None for a plain tensor."""
    return local_tensor(p) if isinstance(p, DTensor) else None


def _local_now(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (a leaf sharing its storage; a fresh view of it where torch
    marks a parameter's local tensor as a parameter too); a plain tensor as is."""
    with torch.no_grad():
        return _local(p)


def offloaded(module: torch.nn.Module, offload: dict[str, str], kind: str,
              tiers: tuple[str, ...] = ("host",)) -> list[tuple[list[str], torch.nn.Parameter, str]]:
    """(every name, parameter, tier) of each parameter of `module` whose `kind` ("gradients",
    "parameters") plan.offload puts in one of `tiers`, after checking the keys; another tier than
    "device" or those is refused."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
        params[id(p)] = p
    check_keys(offload, [n for ns in names.values() for n in ns], kind)
    bad = sorted((k, v) for k, v in offload.items() if k.startswith(f"{kind}:") and v not in ("device", *tiers))
    if bad:
        raise AutoparError(f"plan.offload[{bad[0][0]!r}] = {bad[0][1]!r}: {kind} go to "
                           f"{' or '.join(repr(t) for t in tiers)} or stay on 'device'")
    placed = [(names[k], p, offload_tier(offload, kind, names[k])) for k, p in params.items()]
    return [(ns, p, tier) for ns, p, tier in placed if tier != "device"]


def check_keys(offload: dict[str, str], fqns: list[str], kind: str = "optimizer") -> None:
    """Every `plan.offload["<kind>:..."]` key names a parameter or layer of this model, with a tier."""
    known = set(fqns) | {layer_key(n) for n in fqns if layer_key(n)}
    for key, tier in offload.items():
        if not key.startswith(f"{kind}:"):
            continue
        what = key.split(":", 1)[1]
        if what not in known:
            raise AutoparError(f"plan.offload[{key!r}]: {what!r} is no parameter or layer of this model "
                               f"(layers: {', '.join(sorted(k for k in known if k not in fqns)) or 'none'})")
        if tier not in TIERS:
            raise AutoparError(f"plan.offload[{key!r}] = {tier!r} is not one of {TIERS}")

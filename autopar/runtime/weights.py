"""Where a distributed module's parameter values come from (`init=`, `checkpoint=`) and where they go
(`save_pretrained`).

`autoparallelize(model, mesh, inputs, checkpoint=PATH)` reads, on each rank, only the slices of its
own shards in the plan's layout:

* a Hugging Face directory of `.safetensors` files (with or without `model.safetensors.index.json`):
  `safetensors.safe_open(...).get_slice(key)[slices]` reads the byte ranges of the slice from the
  mapped file; the values are converted to the model's dtype;
* a torch.distributed.checkpoint directory (`dcp.save` of a distributed module's state dict on any
  mesh): `dcp.load` into DTensors in the plan's layout, which reads each rank's chunks.

A checkpoint key `k` names the model's tensor `key_map(checkpoint_prefix + k)` (`key_map` None: the
identity; `key_map` returning None: the key is skipped). Before any tensor is read, every rank checks
all of the checkpoint's metadata against the model: a parameter with no tensor, a tensor the model has
no parameter or buffer for, a tensor of another shape, a truncated file -> `CheckpointError` naming
the file and the key (every rank reads the same metadata, so every rank raises). Tied parameters are
read once, from whichever of their names the checkpoint holds. Persistent buffers the checkpoint holds
are read whole; buffers it lacks are recomputed by the model's code (`materialise.recompute_buffers`).
"""
from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat import SafeDcpReader
from ..errors import AutoparError, CheckpointError
from ..placement import local_shape
from . import safetensors_files as st
from .materialise import Init, Initialiser, init_function, layout_of, local_slices, recompute_buffers


@dataclass
class Weights:
    """What autoparallelize's `init=`, `checkpoint=`, `checkpoint_prefix=` and `key_map=` asked for;
    `check(model)` validates the checkpoint against the model (no collective) and keeps its index."""
    init: Init | None = None
    checkpoint: str | None = None
    prefix: str = ""
    key_map: Callable[[str], str | None] | None = None
    index: dict[str, tuple[str, st.Entry]] = field(default_factory=dict)    # model name -> (checkpoint key, entry)
    kind: str = ""
    # torch's CPU RNG state when autoparallelize was called: `init` draws from it (capture may draw too)
    rng_state: torch.Tensor = field(default_factory=torch.get_rng_state)

    @classmethod
    def of(cls, init=None, checkpoint=None, checkpoint_prefix: str = "", key_map=None) -> "Weights | None":
        if init is None and checkpoint is None:
            return None
        if key_map is not None and not callable(key_map):
            raise CheckpointError(f"key_map={key_map!r}: give a function from checkpoint key to model name")
        return cls(init_function(init), None if checkpoint is None else os.fspath(checkpoint), checkpoint_prefix,
                   key_map)

    def check(self, model: torch.nn.Module) -> None:
        if self.checkpoint is None:
            return
        path = self.checkpoint
        if st.is_safetensors_dir(path):
            self.kind, entries = "safetensors", st.read_directory(path)
        elif os.path.isfile(os.path.join(path, ".metadata")):
            self.kind, entries = "dcp", _dcp_entries(path)
        else:
            raise CheckpointError(f"checkpoint={path!r}: neither a directory of .safetensors files nor a "
                                  f"torch.distributed.checkpoint directory (no .metadata)")
        self.index = _match(entries, model, self.prefix, self.key_map, path)

    def materialise(self, model: torch.nn.Module, cap, plan, device_mesh, device) -> tuple[dict, dict]:
        """({canonical parameter FQN: this rank's local shard}, {buffer FQN: whole tensor})."""
        canon = cap.param_names
        layout = (lambda key, ndim: layout_of(plan, key, ndim))
        if self.checkpoint is not None:
            locals_, buffers = _load(self, model, canon, layout, device_mesh, device)
        else:
            work = meta_copy(model)
            init = Initialiser(work, self.init, layout, device_mesh, device, lambda n: canon.get(n, n))
            torch.set_rng_state(self.rng_state)     # left as the draws leave it, as after one process's init
            init.run(work)
            locals_, buffers = init.locals, init.buffers
        missing = {n for n, b in model.named_buffers() if b.is_meta and n not in buffers}
        buffers.update(recompute_buffers(model, self.init, missing, device, self.checkpoint or "init"))
        return locals_, buffers


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter on meta (tied ones still one), real buffers copied."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def expected(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameter FQN, every alias -> canonical FQN; canonical FQN -> parameter; buffer FQN -> buffer). Any
    buffer may come from a checkpoint: a distributed module's state dict holds the non-persistent ones too."""
    first: dict[int, str] = {}
    alias, params = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), name)
        alias[name] = canon
        params[canon] = p
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return alias, params, buffers


def _match(entries: dict[str, st.Entry], model, prefix: str, key_map, where: str) -> dict[str, tuple[str, st.Entry]]:
    alias, params, buffers = expected(model)
    index: dict[str, tuple[str, st.Entry]] = {}
    for key, entry in entries.items():
        name = key_map(prefix + key) if key_map is not None else prefix + key
        if name is None:
            continue
        target = params.get(alias.get(name)) if name in alias else buffers.get(name)
        if target is None:
            raise CheckpointError(f"{entry.file}: tensor {key!r} (model name {name!r}) is not a parameter or "
                                  f"buffer of this model: a checkpoint of another model, or a name to map "
                                  f"(checkpoint_prefix=, key_map=; key_map returning None skips a key)")
        if tuple(entry.shape) != tuple(target.shape):
            raise CheckpointError(f"{entry.file}: tensor {key!r} has shape {list(entry.shape)}, the model's "
                                  f"{name!r} has {list(target.shape)}")
        index.setdefault(alias.get(name, name), (key, entry))     # tied parameters: read once
    absent = [n for n in params if n not in index]
    if absent:
        raise CheckpointError(f"{where}: no tensor for parameter {absent[0]!r} ({len(absent)} missing"
                              f"{'' if prefix or key_map else '; names as the checkpoint keys'}): a checkpoint of "
                              f"another model, or names to map with checkpoint_prefix= / key_map=")
    return index


def _dcp_entries(path: str) -> dict[str, st.Entry]:
    """key -> Entry of a torch.distributed.checkpoint directory's tensors, its files' sizes checked."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta_file = os.path.join(path, ".metadata")
    try:
        md = SafeDcpReader(path).read_metadata()
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{meta_file}: not readable checkpoint metadata ({type(e).__name__}: {e})") from None
    for index, info in (md.storage_data or {}).items():
        file = os.path.join(path, info.relative_path)
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size < info.offset + info.length:
            raise CheckpointError(f"{file}: tensor {index.fqn!r} needs bytes up to {info.offset + info.length}, "
                                  f"the file has {max(size, 0)}: truncated or missing")
    return {key: st.Entry(meta_file, key, tuple(m.size), m.properties.dtype)
            for key, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def _load(w: Weights, model, canon: dict, layout, device_mesh, device) -> tuple[dict, dict]:
    _, params, _ = expected(model)
    targets = {}    # model name -> (checkpoint key, entry, layout or None for a whole buffer, model dtype)
    for name, (key, entry) in w.index.items():
        t = params.get(name)
        if t is not None:
            targets[canon.get(name, name)] = (key, entry, layout(canon.get(name, name), t.ndim), t.dtype, True)
        else:
            targets[name] = (key, entry, None, model.get_buffer(name).dtype, False)
    read = _read_safetensors if w.kind == "safetensors" else _read_dcp
    values = read(targets, device_mesh)
    locals_, buffers = {}, {}
    for name, (_, _, _, dtype, is_param) in targets.items():
        (locals_ if is_param else buffers)[name] = values.pop(name).to(device=device, dtype=dtype).contiguous()
    return locals_, buffers


def _read_safetensors(targets: dict, device_mesh) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    by_file: dict[str, list[str]] = {}
    for name, (_, entry, *_) in targets.items():
        by_file.setdefault(entry.file, []).append(name)
    out = {}
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                key, entry, lay = targets[name][:3]
                if lay is None or not entry.shape:
                    out[name] = f.get_tensor(key)
                else:
                    out[name] = f.get_slice(key)[local_slices(entry.shape, lay, device_mesh)]
    return out


def _read_dcp(targets: dict, device_mesh) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from .ops import mesh_device
    device = mesh_device(device_mesh)
    state = {}
    for name, (key, entry, lay, _, _) in targets.items():
        if lay is None:
            state[key] = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        else:
            local = torch.empty(local_shape(entry.shape, lay, tuple(device_mesh.shape)), dtype=entry.dtype,
                                device=device)
            state[key] = DTensor.from_local(local, device_mesh, lay, run_check=False, shape=torch.Size(entry.shape),
                                            stride=torch.empty(entry.shape, device="meta").stride())
    dcp.load(state, storage_reader=SafeDcpReader(os.path.dirname(next(iter(targets.values()))[1].file)))
    return {name: (state[key].to_local() if isinstance(state[key], DTensor) else state[key])
            for name, (key, *_) in targets.items()}


def save_pretrained(dmodel, directory: str, max_shard_size="5GB") -> list[str]:
    """Write the module's parameters and persistent buffers as a Hugging Face safetensors directory (and
    the model's `config.json` when it has a Hugging Face config), one tensor at a time from rank 0; every
    rank must call it (gathering a split parameter is a collective). -> the files written."""
    model, cap = dmodel._autopar["model"], dmodel._autopar["cap"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    seen, tensors = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        canon = cap.param_names.get(name, name)
        if canon in seen:       # a tied parameter: written once, under its first name (as Hugging Face saves)
            continue
        seen.add(canon)
        tensors.append((canon, tuple(t.shape), t.dtype))

    def value(i: int) -> torch.Tensor:
        name = tensors[i][0]
        t = dmodel.get_parameter(name) if name in cap.param_names.values() else dmodel.get_buffer(name)
        return t.full_tensor() if isinstance(t, DTensor) else t

    files = st.write_directory(directory, tensors, value, max_shard_size, writer=rank == 0)
    config = getattr(model, "config", None)
    if rank == 0 and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()      # the directory is complete when any rank returns
    return files


def unmaterialised(model: torch.nn.Module) -> AutoparError:
    return AutoparError("the model's parameters are on the meta device: planning works on meta, but running needs "
                        "values: pass autoparallelize(..., init=FN or 'reset') to initialise them shard by shard, "
                        "or checkpoint=DIR (Hugging Face safetensors or torch.distributed.checkpoint) to load them")

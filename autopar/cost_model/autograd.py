"""Backward work that belongs to no op's own backward kernel, as PyTorch's autograd engine runs it.

`compute.op_times` prices each op's backward kernel from its forward (BACKWARD_FACTORS). The engine
runs more kernels than those, and they are memory-bound passes over gradient-sized tensors:

* a tensor consumed by k ops that need its gradient receives k gradients and sums them: k - 1
  additions, each reading two gradients and writing one (the engine's InputBuffer accumulation);
  a transformer's residual stream, used by a layer norm and by the residual add, pays one per
  sub-layer;
* split / chunk / unbind: the pieces' gradients are concatenated into one (`split_backward` is a
  `cat`): read and write the input's size once;
* an input broadcast by an add/sub/mul/div gets its gradient summed down to its shape
  (`sum_to_size`): one more read of the output-sized gradient (a position embedding added to a
  batch, a bias added after a matmul, a norm's weight);
* mul/div with several tensor inputs that need gradients run one gradient kernel per such input
  (dx = dy * other reads dy and the other input, writes dx): BACKWARD_FACTORS prices one;
* a linear/addmm bias gradient is the column sum of dY (one read of the output gradient);
* expand: the gradient is summed over the expanded dims (one read of the output gradient);
* slice / select / narrow: `slice_backward` fills an input-sized zero tensor and copies the
  gradient into its slice (rotary embeddings' halves, a last-token pick).

A parameter used by several ops (tied embeddings) sums their gradients the same way
(AccumulateGrad), on its local shard.

`GradWork` counts them per node in passes over the node's local output (gradient) size, over all
its outputs together (a split's input size) and over its inputs, plus the kernels they launch;
`grad_work_time` prices them like any memory-bound kernel.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .profiles import DeviceProfile
from ..symbolic import is_zero

__all__ = ["GradWork", "NO_GRAD_WORK", "grad_work", "grad_work_time", "gradient_sums_time", "SUM_PASSES", "CAT_PASSES",
           "BROADCAST_REDUCE_PASSES", "EXTRA_GRAD_KERNEL_PASSES", "BIAS_GRAD_PASSES", "SLICE_ZEROS_PASSES",
           "SLICE_COPY_PASSES"]

# Passes over a gradient-sized tensor, from what each kernel reads and writes.
SUM_PASSES = 3.0                 # a + b -> c: read two gradients, write their sum
CAT_PASSES = 2.0                 # cat of the pieces: read them, write one tensor of the input's size
BROADCAST_REDUCE_PASSES = 1.0    # sum_to_size: read the output-sized gradient (the write is input-sized, small)
EXTRA_GRAD_KERNEL_PASSES = 3.0   # d(other input) = dy * x: read dy and x, write the gradient
BIAS_GRAD_PASSES = 1.0           # db = dY.sum(rows): read dY
SLICE_ZEROS_PASSES = 1.0         # slice_backward: write the input-sized zeros ...
SLICE_COPY_PASSES = 2.0          # ... then copy the gradient into its slice (read it, write it)

_SPLITS = ("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind")
_BROADCASTING = ("aten.add", "aten.sub", "aten.mul", "aten.div")
_PRODUCTS = ("aten.mul", "aten.div")
_SLICES = ("aten.slice", "aten.select", "aten.narrow")


@dataclass(frozen=True, slots=True)
class GradWork:
    out_passes: float = 0.0      # passes over the node's (first) local output
    all_passes: float = 0.0      # passes over all its local outputs together (a split's input)
    in_passes: float = 0.0       # passes over its local inputs
    kernels: int = 0
    sums: int = 0                # gradients from several consumers added up (SUM_PASSES each, own kernel)

    def __bool__(self) -> bool:
        return bool(self.kernels or self.sums)


NO_GRAD_WORK = GradWork()


def grad_work(op: str, n_outputs: int, out_shape: Sequence, in_shapes: Sequence[Sequence | None],
              in_needs_grad: Sequence[bool], grad_consumers: int, bias_needs_grad: bool) -> GradWork:
    """The autograd work of one node that needs a gradient (module docstring).

    op: aten name ("aten.mul"); n_outputs: tensor outputs; in_shapes / in_needs_grad: per tensor
    input (None for a non-tensor); grad_consumers: ops that use this node's output and need a
    gradient; bias_needs_grad: a linear/addmm whose bias is trained."""
    out_p, all_p, in_p, k = 0.0, 0.0, 0.0, 0
    sums = grad_consumers - 1 if n_outputs == 1 and grad_consumers > 1 else 0
    if op in _SPLITS:
        all_p += CAT_PASSES
        k += 1
    if op in _BROADCASTING:
        for shape, ng in zip(in_shapes, in_needs_grad):
            if ng and shape is not None and _broadcast(shape, out_shape):
                out_p += BROADCAST_REDUCE_PASSES
                k += 1
    if op in _PRODUCTS:
        extra = sum(1 for shape, ng in zip(in_shapes, in_needs_grad) if ng and shape is not None) - 1
        if extra > 0:
            out_p += EXTRA_GRAD_KERNEL_PASSES * extra
            k += extra
    if bias_needs_grad:
        out_p += BIAS_GRAD_PASSES
        k += 1
    if op == "aten.expand":
        out_p += BROADCAST_REDUCE_PASSES
        k += 1
    if op in _SLICES:
        in_p += SLICE_ZEROS_PASSES
        out_p += SLICE_COPY_PASSES
        k += 2
    return GradWork(out_p, all_p, in_p, k, sums)


def _broadcast(shape: Sequence, out_shape: Sequence) -> bool:
    """Is a tensor of `shape` expanded to `out_shape` (structurally: fewer dims, or a size-1 dim where
    the output's is not 1)? Works on ints and on sympy sizes alike."""
    if len(shape) < len(out_shape):
        return True
    return any(s == 1 and o != 1 for s, o in zip(shape, out_shape))


def grad_work_time(work: GradWork, out_bytes: float, all_out_bytes: float, in_bytes: float,
                   profile: DeviceProfile) -> float:
    """Seconds of `work` on one device, `out_bytes` / `all_out_bytes` / `in_bytes` being the node's local
    (first) output, all its local outputs together and its local inputs: memory-bound passes plus one
    launch per kernel."""
    if not work.kernels:
        return gradient_sums_time(work, out_bytes, profile)
    nbytes = ((work.out_passes * out_bytes if work.out_passes else 0.0)
              + (work.all_passes * all_out_bytes if work.all_passes else 0.0)
              + (work.in_passes * in_bytes if work.in_passes else 0.0))
    return _passes_time(nbytes, work.kernels, profile) + gradient_sums_time(work, out_bytes, profile)


def gradient_sums_time(work: GradWork, out_bytes: float, profile: DeviceProfile) -> float:
    """The part of `grad_work_time` that adds up gradients from several consumers (it runs when the
    consumers' gradients arrive: `autopar.estimate` books it with the first consumer's layer)."""
    if not work.sums:
        return 0.0
    return _passes_time(SUM_PASSES * work.sums * out_bytes, work.sums, profile)


def _passes_time(nbytes: float, kernels: int, profile: DeviceProfile) -> float:
    """Memory-bound kernels moving `nbytes` in all, one launch each."""
    t = kernels * profile.kernel_overhead
    return t if is_zero(nbytes) else nbytes / (profile.memory_bandwidth * profile.memory_efficiency) + t

"""The grouped-experts executor's work besides its two grouped GEMMs, and what it keeps for the backward.

A MoE layer (`autopar::moe_experts`) runs as `passes.lowering.moe_grouped` (expert parallel:
`runtime/experts.py` around `passes.lowering.experts_in_order`): the token-slots a device's experts take
are sorted by expert, gathered, run through gate/up and down as two `grouped_mm` calls, weighted by
the router and added into their tokens; autograd runs the GEMMs' backward (dX and dW grouped GEMMs,
priced with the op's FLOPs: `compute.BACKWARD_FACTORS["moe"]`), nothing recomputed. The rest are
memory-bound passes, priced here per token-slot, in elements of the hidden width H and of the
expert's intermediate width I on the device (I / the expert_tp axis):

    forward   gather the slot's row (read H, write H), silu(gate) (read I, write I), silu(gate) * up
              (read 2I, write I), the router weight (read H, write H), the add into its token
              (read H, read and write the token's H): 7H + 5I
    backward  the add's gradient gathered (2H), the weight's product for dy and dw (2H + 2H), the
              product's two gradients (3I + 3I), silu's (3I), gate and up gradients joined (4I), the
              gathered row's gradient added into its token (3H): 9H + 13I
    expert parallel, besides: the rows gathered before the all-to-all and restored to their order
              after the way back (2H + 2H), forward and backward alike

and FORWARD_KERNELS / BACKWARD_KERNELS launches (sort, count, offsets, the gathers, activation,
products, the add). Saved for the backward per slot (`expert_saved_bytes`): its sorted row (H),
gate/up (2I), silu(gate) (I), their product (I), the expert's output for the router weight's
gradient (H, where the slot's token lives), SLOT_INDEX_BYTES of indices and weight, and OFFSET_BYTES
per local expert.
"""
from __future__ import annotations

from .profiles import DeviceProfile

# element passes per token-slot, as (hidden-wide, intermediate-wide) elements (module docstring)
FORWARD_PASSES = (7, 5)
BACKWARD_PASSES = (9, 13)
EXCHANGE_PASSES = (4, 0)            # expert parallel's gathers around the all-to-all, each direction
FORWARD_KERNELS = 10                # argsort, bincount, cumsum, 2 gathers, silu, 2 products, zeros, index_add
BACKWARD_KERNELS = 10
# per slot kept for the backward: two int64 indices (the sort's order, the slot's token) and a float32 weight
SLOT_INDEX_BYTES = 8 + 8 + 4
OFFSET_BYTES = 4                    # per local expert: the end of its rows (int32), kept by grouped_mm


def expert_pass_times(slots, hidden, inter, itemsize: int, exchange: bool, profile: DeviceProfile) -> tuple:
    """(forward, backward) seconds of the element-wise passes on `slots` token-slots of one device."""
    bandwidth = profile.memory_bandwidth * profile.memory_efficiency
    extra = EXCHANGE_PASSES if exchange else (0, 0)

    def seconds(passes, kernels):
        elements = (passes[0] + extra[0]) * hidden + (passes[1] + extra[1]) * inter
        return slots * elements * itemsize / bandwidth + kernels * profile.kernel_overhead
    return seconds(FORWARD_PASSES, FORWARD_KERNELS), seconds(BACKWARD_PASSES, BACKWARD_KERNELS)


def expert_saved_bytes(slots, combined, hidden, inter, itemsize: int, experts):
    """Bytes one device keeps for the backward: `slots` run by its `experts`, `combined` added into its
    tokens (the same slots, unless expert parallel sends them elsewhere to run)."""
    return (slots * ((hidden + 4 * inter) * itemsize + SLOT_INDEX_BYTES) + combined * hidden * itemsize
            + experts * OFFSET_BYTES)

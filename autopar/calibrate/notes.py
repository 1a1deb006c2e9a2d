"""How each figure of a calibrated profile was measured: the profile file's `_notes`, in words, with
the sizes the measurements used."""
from __future__ import annotations

from .collectives import BURST_REPEATS, BURST_SHAPE
from .device import RATE_ROUNDS
from .runtime_costs import OVERLAP_DEPTH, OVERLAP_ROWS, OVERLAP_WIDTH, TINY_DEPTH, TINY_WIDTH


def notes(comp: list, base_name: str) -> dict[str, str]:
    """How each figure of the profile was measured (the profile file's `_notes`)."""
    return {
        "peak_flops": f"torch.mm of square matrices (n={comp[0]['matmul_n']}, smaller for dtypes without a fast "
                      f"kernel), median over {RATE_ROUNDS} rounds spread over the calibration, then over ranks: "
                      "achieved rates, hence matmul_efficiency = 1",
        "memory_bandwidth": "y.copy_(x), read + write bytes, median over ranks",
        "links": "ring alpha-beta fits per mesh axis: latency per ring step from isolated back-to-back collectives "
                 "(the transport's, under each axis's 'isolated'); bandwidth from the slope of all_reduce and "
                 "all_gather issued as a training step issues them (a compute burst, then DTensor redistribute, "
                 "cycling over the axes; minus the bursts alone), mean over ranks, bounded by the isolated "
                 "bandwidth (see _measured.collectives); intra_node is the slowest axis; figures not measured "
                 "come from the base profile " + base_name,
        "kernel_overhead": "a 16-element add, median over ranks (eager PyTorch's per-op dispatch)",
        "attention_efficiency": "causal scaled_dot_product_attention, forward + backward, at (batch, heads, sequence, "
                                f"head dim) {comp[0]['attention']['shape']} ({comp[0]['attention']['dtype']}): the "
                                "planner's price of it at the matmul rate over its time (median over "
                                f"{RATE_ROUNDS} rounds, then over ranks)",
        "disk_link": "a file of 64 MiB written, fsync'ed and read back memory-mapped (torch.from_file), as the "
                     "disk offload tier does, minus the same for 4 KiB (latency: half of that small round trip); "
                     "median over ranks",
        "host_optimizer_element_time": "torch.optim.AdamW().step() over one fp32 CPU tensor of 2^20 elements, per "
                                       "element: the optimizer step of offloaded parameters; median over ranks",
        "rng_element_time": "the runtime's dropout (runtime/rng.draw, p = 0.1) of fp32 x (up to 4M elements on CPU), minus "
                            "the time its bytes (read x, write y and a 1-byte mask) take at memory_bandwidth, per "
                            "element; median over ranks",
        "collective_overhead": "per collective beyond the ring terms and kernel_overhead: DTensor's redistribute and "
                               "waiting for the peers to be scheduled, after a burst of " + str(BURST_REPEATS) + " "
                               "matmuls of " + "x".join(map(str, BURST_SHAPE)) + " (what a collective adds grows "
                               "with the compute before it); holds for the launch in _measured.launch",
        "runtime_op_overhead": f"per node of the rank's graph (LocalOp, Reshard, ToLocal), forward + backward: a "
                               f"{TINY_DEPTH}-block transformer (attention, MLP) of width {TINY_WIDTH} through "
                               "autoparallelize (all replicated: no collective) minus the same model in eager "
                               "PyTorch, divided by the graph's nodes; median over ranks",
        "grad_sync_overlap": f"the share of the gradient buckets' transfer a backward hides, as the runtime runs them: a "
                             f"data-parallel step of {OVERLAP_DEPTH} linear layers of width {OVERLAP_WIDTH} ({OVERLAP_ROWS} "
                             "rows per rank, a bucket per layer) against the same compute with nothing to reduce, "
                             "against the same buckets' all-reduces alone; the last bucket, launched when the backward "
                             "ends, is priced exposed (cost_model.comm.final_bucket_time); median over ranks",
        "optimizer_param_overhead": "torch.optim.AdamW().step() on that graph's DTensor parameters, divided by their "
                                    "number (their bytes are negligible); median over ranks",
        "optimizer_element_time": "the same AdamW step on one replicated DTensor parameter of 2^20 elements, minus "
                                  "optimizer_param_overhead, per element: torch's default CPU AdamW runs one kernel "
                                  "per operation of the update (about 19 passes of 4 bytes, not the fused 28 bytes "
                                  "cost_model.compute assumes); median over ranks",
    }

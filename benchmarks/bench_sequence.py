"""Growing sequences (issue 13): attention split four ways, Megatron sequence parallelism on and off.

    python benchmarks/bench_sequence.py [--layers N] [--seqs 2048,8192,32768,131072] [--modes off,on]

Hugging Face Llama-3-8B's configuration (LlamaForCausalLM from its config, bf16, AdamW; the first
`--layers` of its 32 layers, so memory and time are those of that many layers) at growing sequence
lengths, global batch 2, on one node of 8 H100 as `Mesh((2, 4), ("cp", "tp"))`: Megatron tensor
parallelism over "tp" (q/k/v/gate/up column-parallel, o/down row-parallel, attention split on
heads), and the attention over "cp" split on the batch (data parallel), on the heads (the sequence
moved to heads and back around it), by ring attention or by Ulysses (inputs split on the sequence
over "cp" for the last three). Each with Megatron-SP "off" (the norms and the residual stream whole
over "tp", gathered activations kept: `residency="keep"`), "layouts" (split on the sequence over
"tp": an all-gather before each column product and a reduce-scatter after each row product, the
gathered inputs kept for the backward) and "on" (those layouts, the column products' inputs saved
as their sequence shard and re-gathered in the backward: `residency="regather"`, Korthikanti et
al. 2022); with `--modes`, also "layouts" and "planner" (the norms' layouts and the residency left
to the planner). Every plan has the same other decisions: no
recomputation, no offload. Prints one JSON line per plan: predicted step time, tokens/s per GPU,
peak memory per device, or the least memory the layouts need when they do not fit in 80 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's autopar
import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.layers import module_path  # noqa: E402
from autopar.views.report import tensor_parallel_family  # noqa: E402
from bench_context_parallel import LLAMA3_8B  # noqa: E402

BATCH = 2
MESH = ((2, 4), ("cp", "tp"))
ATTENTION = ("batch", "heads", "ring", "ulysses")
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
# (the norms and residual stream over "tp": whole, split on the sequence, or the planner's; residency)
SP_MODES = {"off": (False, "keep"), "layouts": (True, "keep"), "on": (True, "regather"), "planner": (None, "auto")}


def node_roles(layers: int) -> dict[str, str]:
    """Node name -> "column", "row" (weight products) or "stream" (the layers' norm ops and residual
    adds). Node names do not depend on sizes: a tiny copy of the model with as many layers finds them."""
    import transformers
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=128, max_position_embeddings=64))
    ids = torch.zeros(BATCH, 16, dtype=torch.long)
    roles = {}
    for n in capture(tiny, (), {"input_ids": ids, "labels": ids.clone()}).gm.graph.nodes:
        path = module_path(n) if n.op == "call_function" else ""
        leaf = path.rsplit(".", 1)[-1]
        if leaf in COLUMN or leaf in ROW:
            roles[n.name] = "column" if leaf in COLUMN else "row"
        elif ".layers." in f".{path}" and (leaf.endswith("layernorm") or (leaf.isdigit() and "add" in n.name)):
            roles[n.name] = "stream"
    return roles


def megatron_pins(roles: dict[str, str], attention: str, sp: bool | None) -> dict:
    """Pins of a plan: inputs, weight products and attention by label, the norms' ops and the residual
    adds by layout ("cp" then "tp"; sp None: left to the planner)."""
    cp_layout, cp_label = ("S(1)", "dim1") if attention != "batch" else ("S(0)", "batch")
    pins = {"input_ids": (cp_layout, "R"), "labels": (cp_layout, "R"),
            "scaled_dot_product_attention*": (attention, "heads")}
    for name, role in roles.items():
        if role != "stream":
            pins[name] = (cp_label, role)
        elif sp is not None:
            pins[name] = (cp_layout, "S(1)" if sp else "R")
    return pins


def run(layers: int, seqs: list[int], time_limit: float, modes: list[str]) -> None:
    import transformers
    cfg = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    mesh = autopar.Mesh(*MESH, device="h100")
    roles = node_roles(layers)
    for seq in seqs:
        ids = torch.zeros(BATCH, seq, dtype=torch.long, device="meta")
        for attention in ATTENTION:
            for mode in modes:
                sp, residency = SP_MODES[mode]
                row = {"bench": f"llama3-8b {layers} layers 8xH100 (cp 2, tp 4) {BATCH}x{seq}",
                       "attention": attention, "megatron_sp": mode}
                t0 = time.perf_counter()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        plan = autopar.plan(model, (), mesh, example_kwargs={"input_ids": ids, "labels": ids.clone()},
                                            pins=megatron_pins(roles, attention, sp), sharded_outputs=True,
                                            time_limit=time_limit, symbolic=False, recompute="none",
                                            offload="none", residency=residency)
                except autopar.InfeasibleError as e:
                    row.update(feasible=False, min_memory_gib=round((e.min_memory_bytes or 0) / 2**30, 1))
                else:
                    est = plan.estimate
                    row.update(feasible=True, step_s=round(est.step_time_s, 4),
                               tokens_per_s_per_gpu=round(BATCH * seq / est.step_time_s / mesh.size, 1),
                               peak_gib=round(est.peak_memory_bytes / 2**30, 2),
                               activation_gib=round(est.activation_bytes / 2**30, 2),
                               family=tensor_parallel_family(plan).describe())
                row["plan_s"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", default="2048,8192,32768,131072")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--modes", default="off,on", help=f"Megatron-SP modes, of {', '.join(SP_MODES)}")
    a = ap.parse_args()
    run(a.layers, [int(s) for s in a.seqs.split(",")], a.time_limit, a.modes.split(","))


if __name__ == "__main__":
    main()

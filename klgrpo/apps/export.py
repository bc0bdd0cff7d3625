"""``klgrpo export CHECKPOINT OUT``: a checkpoint folder as a from_pretrained folder (weights, config, tokenizer).

A checkpoint written with train.sharded_checkpoints holds each process's shards (``sharded/``): they are joined
into whole weights here, on one process. A whole checkpoint is loaded and saved again (the trainer state is
left behind either way).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from klgrpo.apps.commands import command_parser
from klgrpo.errors import KLGRPOError, first_line


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("export", "CHECKPOINT is runs/<name>/checkpoints/step_N; OUT loads with transformers' "
                                      "from_pretrained.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder: runs/<name>/checkpoints/step_N")
    parser.add_argument("out", metavar="OUT", help="the folder to write (new, or empty)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.out.strip():  # Path("") is the current folder
        raise KLGRPOError("OUT is empty; pass the folder to write (new, or empty)")
    export(Path(args.checkpoint), Path(args.out))
    print(f"klgrpo export: wrote {args.out}")
    return 0


def export(checkpoint: Path, out: Path) -> None:
    from klgrpo.apps.models import verify_checkpoint

    _check_paths(checkpoint, out)
    verify_checkpoint(checkpoint)
    model, tokenizer = _load(checkpoint)
    _write_whole(out, model, tokenizer)


def _check_paths(checkpoint: Path, out: Path) -> None:
    from klgrpo.apps.outputs import check_output

    if not (checkpoint / "config.json").is_file():
        raise KLGRPOError(f"{checkpoint} is not a checkpoint folder (no config.json); pass "
                          f"runs/<name>/checkpoints/step_N")
    check_output(out, "OUT", {"the checkpoint": checkpoint}, folder=True)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KLGRPOError(f"{out} exists and is not an empty folder; pass a new folder as OUT")


def _load(checkpoint: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from klgrpo.backends.hf import pretrained_causal_lm
    from klgrpo.store.checkpoint import SHARDS_DIR
    from klgrpo.store.sharded_checkpoint import load_sharded_weights

    shards = checkpoint / SHARDS_DIR
    whole = any((checkpoint / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))
    try:
        if shards.is_dir():
            config = AutoConfig.from_pretrained(checkpoint)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None))
            load_sharded_weights(model, shards)
        elif whole:  # every weight there and nothing else (a missing one would be exported at random)
            model = pretrained_causal_lm(str(checkpoint), "", f"{checkpoint} cannot be read", strict=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except KLGRPOError:
        raise
    except Exception as exc:  # torch.distributed.checkpoint, safetensors and transformers raise several types
        raise KLGRPOError(f"{checkpoint} cannot be read ({type(exc).__name__}: {first_line(exc)}); pass an intact "
                          f"checkpoint folder") from None
    return model, tokenizer


def _write_whole(out: Path, model, tokenizer) -> None:
    """Write into a temporary sibling renamed into place: a full disk or a kill leaves no half-written OUT."""
    tmp = out.with_name(f".{out.name}.tmp_{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except Exception as exc:  # an OSError, or safetensors' own error wrapping one (a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError) and type(exc).__name__ != "SafetensorError":
            raise
        reason = getattr(exc, "strerror", None) or first_line(exc)
        raise KLGRPOError(f"cannot write {out} ({reason}); nothing was left there: pass a writable folder with "
                          f"free space") from None

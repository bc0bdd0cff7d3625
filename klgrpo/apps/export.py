"""``klgrpo export CHECKPOINT OUT``: a checkpoint folder as a from_pretrained folder (weights, config, tokenizer).

A checkpoint written with train.sharded_checkpoints holds each process's shards (``sharded/``): they are joined
into whole weights here, on one process. A whole checkpoint is loaded and saved again (the trainer state is
left behind either way).
"""

from __future__ import annotations

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
    export(Path(args.checkpoint), Path(args.out))
    print(f"klgrpo export: wrote {args.out}")
    return 0


def export(checkpoint: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from klgrpo.train.checkpoint import SHARDS_DIR
    from klgrpo.train.sharded_checkpoint import load_sharded_weights

    shards = checkpoint / SHARDS_DIR
    if not (checkpoint / "config.json").is_file():
        raise KLGRPOError(f"{checkpoint} is not a checkpoint folder (no config.json); pass "
                          f"runs/<name>/checkpoints/step_N")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KLGRPOError(f"{out} exists and is not an empty folder; pass a new folder as OUT")
    try:
        if shards.is_dir():
            config = AutoConfig.from_pretrained(checkpoint)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None))
            load_sharded_weights(model, shards)
        else:
            model = AutoModelForCausalLM.from_pretrained(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except Exception as exc:  # torch.distributed.checkpoint, safetensors and transformers raise several types
        raise KLGRPOError(f"{checkpoint} cannot be read ({type(exc).__name__}: {first_line(exc)}); pass an intact "
                          f"checkpoint folder") from None
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except OSError as exc:
        raise KLGRPOError(f"cannot write {out} ({exc.strerror or exc}); pass a writable folder") from None

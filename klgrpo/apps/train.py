"""``klgrpo train``: defaults < --config YAML < dotted overrides; no model configured -> the embedded demo."""

from __future__ import annotations

import os
import sys

from klgrpo.apps.args import USAGE, parse_args
from klgrpo.apps.summary import print_run_summary
from klgrpo.errors import KLGRPOError
from klgrpo.train.config import config_help

def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + config_help())
        return 0
    try:
        cfg, opts = parse_args(argv)
        if not cfg.model.name_or_path:
            from klgrpo.apps.demo_run import run_demo

            return run_demo(argv, resume=opts["resume"], print_config=opts["print_config"])
        if opts["print_config"]:
            print(cfg.to_yaml())
            return 0
        if os.environ.get("RANK", "0") == "0":  # seconds of imports: say so first, once under torchrun
            print("klgrpo train: loading torch and transformers", flush=True)
        from klgrpo.train.trainer import GRPOTrainer

        trainer = GRPOTrainer(cfg)
        summary = trainer.train(resume=opts["resume"])
        if trainer.dist.is_main:  # once, not once per process
            print_run_summary(summary, trainer.run_dir)
        return 0
    except KLGRPOError as exc:
        print(f"klgrpo train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("klgrpo train: interrupted", file=sys.stderr)
        return 130

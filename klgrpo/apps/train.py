"""``klgrpo train``: defaults < --config YAML < dotted overrides; no model configured -> the embedded demo.

Exit codes: 0 done, 2 a bad input or a run that cannot go on (one line on stderr), 3 stopped on a KL runaway
(kl.on_runaway stop: the summary names the checkpoint to train on from), 130 Ctrl-C, 143 SIGTERM (both save the
last complete step first; continue with --resume latest), 1 another process of a multi-process run failed (one
line; that process's own output says why) or an unexpected error (a traceback). A script can tell each from the
others: ``klgrpo train && klgrpo eval`` evaluates only a run that finished.
"""

from __future__ import annotations

import os
import sys

from klgrpo.apps.args import USAGE, read_argv
from klgrpo.apps.summary import lora_line, print_run_summary
from klgrpo.config.schema import config_help
from klgrpo.errors import KLGRPOError


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + config_help())
        return 0
    run_dir, fresh = None, False
    try:
        command = read_argv(argv)  # once: the demo resolves its own config from the same CommandLine
        cfg, opts = command.config(), command.options()
        fresh = not opts["resume"]  # --resume auto never discards: the folder may hold its earlier attempts
        if not cfg.model.name_or_path:
            return _run_demo(command, cfg, opts)
        if opts["print_config"]:
            cfg.validate()  # a config that train would refuse (or this environment cannot run) is not printed
            print(cfg.to_yaml())
            return 0
        if os.environ.get("RANK", "0") == "0":  # seconds of imports: say so first, once under torchrun
            print("klgrpo train: loading torch and transformers", flush=True)
        run_dir = _early_checks(cfg, opts)
        lora = lora_line(cfg)
        if lora and os.environ.get("RANK", "0") == "0":
            print(lora, flush=True)
        from klgrpo.run.trainer import GRPOTrainer

        trainer = GRPOTrainer(cfg)
        run_dir = trainer.run_dir
        summary = trainer.train(resume=opts["resume"], overwrite=opts["overwrite"])
        if trainer.dist.is_main:  # once, not once per process
            print_run_summary(summary, trainer.run_dir, lora=lora)
        return _finish(RUNAWAY_STOP_EXIT if stopped_on_runaway(summary) else 0)
    except KLGRPOError as exc:
        print(f"klgrpo train: error: {exc}", file=sys.stderr)
        if fresh and run_dir is not None and os.environ.get("RANK", "0") == "0":  # rank 0 owns the folder
            from klgrpo.store.run_folder import discard_unstarted_run

            discard_unstarted_run(run_dir)
        return 2
    except Exception as exc:  # noqa: BLE001 -- a lost peer is one line; anything else keeps its traceback
        lost = _lost_peer_message(exc)
        if lost is None:
            raise
        print(f"klgrpo train: error: {lost}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        from klgrpo.train.stop_signals import Terminated

        if isinstance(exc, Terminated):
            print("klgrpo train: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print("klgrpo train: interrupted", file=sys.stderr)
        return 130


#: the exit status of a run that kl.on_runaway stop ended (its summary's stopped_early says where and why)
RUNAWAY_STOP_EXIT = 3


def stopped_on_runaway(summary: dict) -> bool:
    from klgrpo.run.runaway import STOPPED

    return any(action.get("action") == STOPPED for action in (summary.get("runaway") or {}).get("actions", []))


def _run_demo(command, cfg, opts) -> int:
    from klgrpo.apps.demo_run import run_demo

    _early_checks_of_demo(cfg, opts)
    code = run_demo(command, user=cfg)  # the config resolved once, in main
    if code == 0:  # every rank finished (a barrier waiting for a failed rank would hang)
        return _finish(code)
    return code


def resolved_config(argv: list[str]):
    """The config ``klgrpo train ARGV`` trains with: with no model configured, the demo's (its defaults and its
    adaptations laid under the arguments; the assets are located, not built)."""
    command = read_argv(argv)
    cfg = command.config()
    if cfg.model.name_or_path:
        return cfg
    from klgrpo.apps.demo.assets import planned_demo_assets
    from klgrpo.apps.demo_run import demo_args

    return demo_args(command, planned_demo_assets(seed=cfg.train.seed), cfg.train.seed, cfg)[0]


def _lost_peer_message(exc: BaseException) -> str | None:
    if "torch" not in sys.modules:  # failed before any process group could exist
        return None
    from klgrpo.train.distributed import lost_peer_message

    return lost_peer_message(exc)


def _early_checks(cfg, opts):
    """What can be refused before a model is built: config values, the run folder, the reward functions."""
    from klgrpo.store.run_folder import check_run_folder
    from klgrpo.train.building import run_dir_for

    cfg.validate()  # errors only here; the trainer prints the warnings
    run_dir = run_dir_for(cfg)
    _check_output_dir(run_dir, cfg)
    check_run_folder(run_dir, cfg, opts["resume"], opts["overwrite"])
    _check_rewards(cfg)
    return run_dir


def _check_output_dir(run_dir, cfg) -> None:
    """The run folder is none of the run's inputs, nor inside one, and holds none where the run writes or
    --overwrite deletes (the one rule of every command's outputs, klgrpo/apps/outputs.py)."""
    from klgrpo.apps.outputs import check_output
    from klgrpo.config.entries import eval_set_specs, reward_specs
    from klgrpo.store.run_folder import CONFIG_FILE, RUN_FILES

    inputs = {"model.name_or_path": cfg.model.name_or_path, "model.tokenizer": cfg.model.tokenizer,
              "kl.reference": cfg.kl.reference, "data.source": cfg.data.source,
              **{f"eval set {s.name}": s.source for s in eval_set_specs(cfg.eval.sets)},
              **{f"reward model {s.model}": s.model for s in reward_specs(cfg.rewards.functions)
                 if hasattr(s, "model")}}
    # config.yaml is the run's record (a resume reads it as --config), not an input it writes over
    check_output(run_dir, "--output-dir", inputs, folder=True, writes=[n for n in RUN_FILES if n != CONFIG_FILE])


def _early_checks_of_demo(cfg, opts) -> None:
    """The demo's config is resolved after its assets are built: check the fields given and the folder now."""
    from klgrpo.config.validation import check_finite_and_ranges
    from klgrpo.store.run_folder import check_run_folder

    check_finite_and_ranges(cfg)
    _check_sampler_installed(cfg)
    if cfg.train.output_dir and not opts["resume"]:
        check_run_folder(cfg.train.output_dir, cfg, None, opts["overwrite"])


def _check_sampler_installed(cfg) -> None:
    from klgrpo.config.validation import check_sampler_installed

    check_sampler_installed(cfg.rollout)


def _check_rewards(cfg) -> None:
    from klgrpo.config.entries import reward_specs
    from klgrpo.core.rewards import RewardComputer

    # A reward model's config is read here; its weights load with the trainer.
    RewardComputer(reward_specs(cfg.rewards.functions),
                   trust_remote_code=cfg.model.trust_remote_code)


def _finish(code: int) -> int:
    """A finished multi-process run takes its process group down and leaves without the interpreter's teardown
    (``exit_now_if_distributed``); a single process returns ``code``."""
    if "torch" in sys.modules:  # the demo's early exits never load it
        from klgrpo.train.distributed import close_process_group, exit_now_if_distributed

        close_process_group()
        exit_now_if_distributed(code)
    return code

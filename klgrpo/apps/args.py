"""The arguments of ``klgrpo train`` (and of the demo it runs): defaults < --config YAML < --group.field overrides."""

from __future__ import annotations

from dataclasses import dataclass, field

from klgrpo.config.schema import GRPOConfig
from klgrpo.errors import KLGRPOError

USAGE = """usage: klgrpo train [--config run.yaml] [--output-dir DIR] [--resume latest|auto|PATH] [--overwrite]
                    [--<group>.<field> VALUE ...]

With no model configured (model.name_or_path empty) this runs the embedded demo: a tiny model is
SFT-trained on arithmetic on the CPU, then trained with GRPO and an adaptive KL, evaluated before and after.

Options:
  --config FILE        YAML file with any of the groups below
  --output-dir DIR     run folder (same as --train.output_dir)
  --resume latest|DIR  continue from the newest checkpoint of the run folder, or from a checkpoint folder;
                       without --config the run folder's config.yaml is used
  --resume auto        continue the run folder's newest checkpoint if it has one, else start fresh (for a
                       launcher that restarts failed workers: torchrun --max-restarts N)
  --overwrite          replace the run already in --output-dir (without it such a folder is refused)
  --print-config       print the resolved config and exit
Every field below can be set as --group.field VALUE (or --group.field=VALUE); VALUE is parsed as YAML.
"""


@dataclass(frozen=True)
class CommandLine:
    """``klgrpo train``'s arguments, read once: the YAML file, the dotted overrides and the options.

    :meth:`config` lays them over any base config (the defaults, or the demo's), without reading argv again."""

    config_file: str | None = None
    overrides: dict = field(default_factory=dict)
    resume: str | None = None
    print_config: bool = False
    overwrite: bool = False
    #: A command's own options (``read_argv(own=...)``): name -> every value given, in order.
    own: dict = field(default_factory=dict)

    def config(self, base: GRPOConfig | None = None) -> GRPOConfig:
        """``base`` (default: GRPOConfig()) < --config YAML < overrides. Without --config and ``base``, --resume
        reads the config.yaml of the run it continues."""
        yaml_file = self.config_file or (_run_config(self.resume, self.overrides.get("train.output_dir"))
                                         if self.resume and base is None else None)
        return (base or GRPOConfig()).layered(yaml_file, self.overrides)

    def options(self) -> dict:
        return {"resume": self.resume, "print_config": self.print_config, "overwrite": self.overwrite}


def read_argv(argv: list[str], own: tuple[str, ...] = ()) -> CommandLine:
    """Split ``argv`` into the config file, the --group.field overrides and the options; nothing is resolved.
    ``own``: the names of a command's own options that take a value (``klgrpo eval``'s --set and --json), kept
    apart from the overrides."""
    config_file, overrides, opts = None, {}, {"resume": None, "print_config": False, "overwrite": False}
    own_values: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # the end-of-options marker a sweep's command line uses; here every override is an option
            i += 1
            continue
        if not arg.startswith("--"):
            raise KLGRPOError(f"unexpected argument {arg!r}; options look like --kl.coef 0.02 "
                              "(see klgrpo train --help)")
        key, eq, value = arg[2:].partition("=")
        if key in ("print-config", "overwrite"):
            opts[key.replace("-", "_")] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise KLGRPOError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_file = value
        elif key in own:
            own_values.setdefault(key, []).append(value)
        elif key == "resume":
            opts["resume"] = value
        elif key in ("output-dir", "train.output_dir"):
            if not value.strip():  # "" would mean the default runs/<run_name>, not what was typed
                raise KLGRPOError(f"--{key} is empty; pass the run folder (or leave --{key} out for runs/<name>)")
            overrides["train.output_dir"] = value
        else:
            overrides[key] = value
    return CommandLine(config_file=config_file, overrides=overrides, own=own_values, **opts)


def parse_args(argv: list[str], base: GRPOConfig | None = None) -> tuple[GRPOConfig, dict]:
    """Resolve ``base`` (default: GRPOConfig()) < --config YAML < overrides; also return the other options."""
    command = read_argv(argv)
    return command.config(base), command.options()


def _run_config(resume: str, output_dir: str | None) -> str | None:
    """--resume without --config: the config.yaml of the run being resumed (its folder, or the run that holds
    the checkpoint folder named); None when there is none (the resume then reports what is missing)."""
    from pathlib import Path

    from klgrpo.errors import ConfigError
    from klgrpo.store.run_folder import run_config_file

    if resume in ("latest", "auto"):
        if not output_dir:
            raise ConfigError(f"--resume {resume} needs --output-dir DIR: the run folder to continue")
        home = Path(output_dir)
    else:
        home = Path(resume).parent.parent
    path = run_config_file(home)
    if path is not None:
        return str(path)
    if resume != "auto" and (home / "checkpoints").is_dir():  # a run without its config: never guess one
        raise ConfigError(f"--resume {resume}: {home / 'config.yaml'} is missing or empty, so the run's settings are "
                          f"unknown; pass the run's config with --config")
    return None

"""The experiment trackers a config may name in ``logging.report_to``, and the check that each exists and is
installed (run/trackers.py runs them)."""

from __future__ import annotations

import importlib.util

from klgrpo.errors import ConfigError

#: logging.report_to names -> the package each needs (import name, and the pip name of klgrpo's extra or the package).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow",
                    "aim": "aim", "comet_ml": "comet_ml", "clearml": "clearml", "dvclive": "dvclive",
                    "swanlab": "swanlab"}
#: klgrpo's optional extras that install a tracker (pip install "klgrpo[NAME]").
TRACKER_EXTRAS = ("trackio", "wandb", "mlflow")


def active_trackers(report_to: list | None, tensorboard: bool = True) -> list:
    """The trackers a run reports to: ``report_to`` (None: TensorBoard alone), without TensorBoard when
    logging.tensorboard is false."""
    names = report_to if report_to is not None else ["tensorboard"]
    return [n for n in names if n != "tensorboard" or tensorboard]


def check_report_to(names: list, field: str = "logging.report_to") -> None:
    """Unknown names and trackers whose package is missing: one line each, with the install command."""
    if not isinstance(names, list):
        raise ConfigError(f"{field} must be a list of tracker names, e.g. [tensorboard, wandb]; got {names!r}")
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"{field}: unknown tracker {name!r}; choose from {', '.join(TRACKER_PACKAGES)} "
                              f"([] for metrics.jsonl only)")
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if name not in LOGGER_TYPE_TO_CLASS:
            raise ConfigError(f"{field} names {name}, which this accelerate version has no tracker for: "
                              f"pip install -U accelerate")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            install = f'pip install "klgrpo[{name}]"' if name in TRACKER_EXTRAS else f"pip install {name}"
            raise ConfigError(f"{field} names {name} but its package is not installed: {install}, or drop it "
                              f"from {field}")

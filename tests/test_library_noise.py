"""The known library lines a `klgrpo` run silences (klgrpo/apps/library_noise.py), each by its module, category
or logger and message: transformers' activation-checkpointing FutureWarnings and DeepSpeed's accelerator
auto-detect line are gone; another FutureWarning of the same module, another DeepSpeed record, a DeepSpeed run's
accelerator line and klgrpo's own warnings still come through."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from helpers.configs import make_config

from klgrpo.apps.cli import main as cli
from klgrpo.apps.library_noise import DEEPSPEED_LOGGER, DeepSpeedAcceleratorLine, silence_known_library_noise
from klgrpo.errors import KLGRPOWarning, warn

DEPRECATED = "is deprecated and will be removed in v6"


def _warn_as(module: str, message: str, category=FutureWarning) -> None:
    """warnings.warn issued from code whose module is ``module`` (what a filter's module regex reads)."""
    code = compile(f"import warnings\nwarnings.warn({message!r}, {category.__name__})", "m.py", "exec")
    exec(code, {"__name__": module, category.__name__: category})


def _recorded(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_transformers_checkpointing_deprecations_are_silenced_and_nothing_else(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # transformers (the pinned release) warns on these two: the filter is needed, and this sees it go
    unfiltered = _recorded(lambda: (model.gradient_checkpointing_enable(), model.is_gradient_checkpointing))
    assert sum(DEPRECATED in w for w in unfiltered) == 2, unfiltered

    def filtered_run():
        silence_known_library_noise()
        model.gradient_checkpointing_enable()
        _ = model.is_gradient_checkpointing
        _warn_as("transformers.modeling_utils", "`something_else` is deprecated")  # another of its warnings
        _warn_as("mylib", "`gradient_checkpointing_enable` is deprecated")  # the same words from another module
        warn("a klgrpo warning")

    assert _recorded(filtered_run) == [
        "FutureWarning: `something_else` is deprecated",
        "FutureWarning: `gradient_checkpointing_enable` is deprecated",
        "KLGRPOWarning: a klgrpo warning",
    ]


def _record(message: str, func: str = "get_accelerator") -> logging.LogRecord:
    return logging.getLogger(DEEPSPEED_LOGGER).makeRecord(
        DEEPSPEED_LOGGER, logging.WARNING, "real_accelerator.py", 213, message, (), None, func=func
    )


def test_deepspeeds_accelerator_line_is_dropped_outside_a_deepspeed_run_only(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    line = DeepSpeedAcceleratorLine()
    assert not line.filter(
        _record("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    )
    assert not line.filter(_record("Setting ds_accelerator to cuda (auto detect)"))
    assert line.filter(_record("Setting ds_accelerator to cuda (auto detect)", func="other"))
    assert line.filter(_record("ZeRO: the optimizer state is offloaded"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert line.filter(_record("Setting ds_accelerator to cuda (auto detect)"))


def test_the_deepspeed_logger_gets_the_filter_once(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    silence_known_library_noise()
    silence_known_library_noise()
    assert sum(isinstance(f, DeepSpeedAcceleratorLine) for f in logger.filters) == 1
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        logger.handle(_record("Setting accelerator to CPU."))
        logger.handle(_record("Using the CPU accelerator's shm op", func="build"))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Using the CPU accelerator's shm op"]


def test_a_lora_run_with_gradient_checkpointing_shows_no_library_warning(
    tiny_model_dir, addition_file, tmp_path, recwarn
):
    pytest.importorskip("peft")
    config = tmp_path / "run.yaml"
    config.write_text(
        make_config(
            tiny_model_dir,
            addition_file,
            tmp_path / "run",
            train={"steps": 1},
            model={"lora": {"r": 2}, "gradient_checkpointing": True},
        ).to_yaml()
    )
    assert cli(["train", "--config", str(config)]) == 0
    library = [str(w.message) for w in recwarn if not issubclass(w.category, KLGRPOWarning)]
    assert not any(DEPRECATED in message for message in library), library

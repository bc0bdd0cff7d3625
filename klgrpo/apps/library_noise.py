"""Lines other libraries print into an ordinary ``klgrpo`` run that tell its user nothing they can act on, each
silenced by what it is (the module that emits it, its category or logger, its message), never by a blanket rule:
any other warning, and every KLGRPOWarning, still prints.

    transformers FutureWarning   ``is_gradient_checkpointing`` / ``gradient_checkpointing_enable`` are deprecated
                                 (transformers 5 renamed them to activation checkpointing): peft reads the first
                                 when it wraps a LoRA model, model.gradient_checkpointing calls the second
    DeepSpeed logger             "Setting accelerator to CPU ..." / "Setting ds_accelerator to ... (auto detect)",
                                 logged at import wherever deepspeed is installed (accelerate imports it at every
                                 checkpoint save); kept in a DeepSpeed run (ACCELERATE_USE_DEEPSPEED), where
                                 the accelerator it found is the run's

The ``klgrpo`` command installs these once per process (``klgrpo.apps.cli``); the Python API leaves the caller's
warning and logging settings alone.
"""

from __future__ import annotations

import logging
import os
import warnings

#: (category, message regex, module regex) of each warnings.warn silenced: passed to warnings.filterwarnings.
KNOWN_WARNINGS = (
    (
        FutureWarning,
        r"`(is_gradient_checkpointing|gradient_checkpointing_enable)` is deprecated",
        r"transformers\.modeling_utils",
    ),
)

#: The logger DeepSpeed writes through (deepspeed.utils.logging: its own handler, no propagation).
DEEPSPEED_LOGGER = "DeepSpeed"
#: The messages of deepspeed/accelerator/real_accelerator.py's get_accelerator, the auto-detect lines.
DEEPSPEED_ACCELERATOR_LINES = ("Setting accelerator to ", "Setting ds_accelerator to ")


class DeepSpeedAcceleratorLine(logging.Filter):
    """Drops DeepSpeed's accelerator auto-detect line outside a DeepSpeed run; every other DeepSpeed record
    passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
            return True
        return not (record.funcName == "get_accelerator" and str(record.msg).startswith(DEEPSPEED_ACCELERATOR_LINES))


def silence_known_library_noise() -> None:
    """Install the filters above (the warnings ones at the front of warnings.filters; the DeepSpeed one on its
    logger, before deepspeed is imported, once)."""
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, DeepSpeedAcceleratorLine) for f in logger.filters):
        logger.addFilter(DeepSpeedAcceleratorLine())


__all__ = ["KNOWN_WARNINGS", "DeepSpeedAcceleratorLine", "silence_known_library_noise"]

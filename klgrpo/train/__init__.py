"""The train room: one GRPO step and its parts. ``GRPOStep`` (``step``, built by ``step_build`` from the typed
plan), its checkpoint (``step_state``), the distributed engine (``engine``, ``distributed``, ``deepspeed_config``),
the non-finite guard, the replay KL anchor, the step's metrics and timings, and what SIGTERM and SIGINT do
(``stop_signals``)."""

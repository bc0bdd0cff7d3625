"""The KL-regularised GRPO math: pure torch functions and tiny state machines, no I/O, no config objects."""

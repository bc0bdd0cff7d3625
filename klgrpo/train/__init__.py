"""The training run around the data path: config and its validation, the trainer loop, checkpoints, the
distributed engine, metrics and plots, evaluation, and the replay KL anchor."""

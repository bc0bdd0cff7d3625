"""The run room: what a run leaves on disk and how it comes back. Checkpoints as safetensors + JSON
(``checkpoint``, ``state_io``, the sharded form in ``sharded_checkpoint``), resuming from the newest that loads
(``resume``), the run folder's safety and lock (``run_folder``) and what SIGTERM and SIGINT do (``stop_signals``).
train/ builds on it; it knows nothing of the trainer's step."""

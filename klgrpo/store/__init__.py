"""The store room: what a run leaves on disk and how it is read back. Checkpoints as safetensors + JSON
(``checkpoint``: the atomic folder, its files, checksums and pruning; ``state_io``; the sharded form in
``sharded_checkpoint``), picking the newest checkpoint that loads (``resume``) and the run folder's safety and
lock (``run_folder``). It knows nothing of the step or the run: train/ and run/ build on it."""

"""The run room: ``TrainingRun`` (``loop``) steps a ``GRPOStep`` to the end, saves and resumes through it, and
around it keeps the run's record: metrics and trackers (``metrics``, ``trackers``, ``tally``), the KL watch and
the runaway guard (``kl_watch``, ``runaway``), evaluation (``evaluation``), plots and the summary (``report``).
``GRPOTrainer`` (``trainer``) is the public entry point that builds the step and the run."""

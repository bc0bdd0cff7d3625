"""The configuration room: the typed tree of a run's settings (``schema``), how a field is declared and read
(``fields``), the checks with their remedies (``validation``), the trackers a config may name (``trackers``) and
the config as the math's typed values and the step's plan (``terms``: ``StepPlan``). It sits between core/ and
run/: it reads the registries of math/, backends/ and core/ (when a name is first checked: importing the config
loads neither torch nor transformers), and knows nothing of folders or the trainer."""

"""The configuration room: the typed tree of a run's settings (``schema``), how a field is declared and read
(``fields``), the checks with their remedies (``validation``), the trackers a config may name (``trackers``) and the
config as the math's typed values (``terms``). It sits between core/ and run/: it reads the registries of math/,
backends/ and core/, and knows nothing of folders or the trainer."""

"""``klgrpo sweep``: a grid of trainings, one run folder per setting and seed, and their table.

    command.py  the command: the plan's runs as subprocesses, the lock, skipping finished runs, the outputs
    plan.py     --grid, --cell and --seeds into runs (settings and their overrides)
    table.py    the runs' summaries into the table (mean, spread, accuracy and retention) and its plots
    paired.py   --baseline: every setting against one on the seeds both ran (paired differences, intervals)
"""

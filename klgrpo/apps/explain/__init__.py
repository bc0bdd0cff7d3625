"""``klgrpo explain``: which KL a TRL, verl, OpenRLHF, Unsloth, NeMo-RL, ROLL or klgrpo config optimises, proven, and
the klgrpo config that reproduces it; with ``--run``, what a run's KL actually did.

    command.py        the command: arguments, outputs (never over an input or, for --write, an existing file)
    reading.py        bounded reading: size, text, plain data (YAML, JSON, TOML), nesting
    sources.py        the format, detected, and its mapping (klgrpo.integrations.trl_mapping, verl_mapping,
                      openrlhf_mapping)
    trl_config.py     what ``trl grpo --config`` reads, from trl_fields.py (TRL's fields as data, no TRL import)
    python_script.py  a training script's GRPOConfig(...) call, read with ``ast`` (never run)
    shell_script.py   a verl, OpenRLHF or SkyRL launch script's command, read as text (never run)
    frameworks.py     the frameworks of this folder's release tables (nemo_rl.json): ranges, --version, labels
    nemo_rl.py        a NeMo-RL GRPO config, per release (nemo_rl.json)
    roll.py           a ROLL RLVR pipeline config, per release (roll.json)
    skyrl_train.py    a SkyRL trainer config or launch script, per skyrl-train release (skyrl_train.json)
    prime_rl.py       a prime-rl RL config (TOML), per release (prime_rl.json)
    slime.py          a slime train.py command line, per release (slime.json)
    truncation.py     sampling filters (top_p, top_k, min_p): the risk line and the rollout keys, per release
                      (truncation.json)
    report.py         the verdicts (verify-kl's exact oracles), the risks and the printed lines
    run_logs.py       --run: a run's KL trajectory, its bands, beta, reward, and the plot
"""

from klgrpo.apps.explain.command import STRICT_EXIT, main
from klgrpo.apps.explain.report import explain

__all__ = ["STRICT_EXIT", "explain", "main"]

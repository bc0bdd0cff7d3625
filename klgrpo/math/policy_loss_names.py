"""The names of the policy losses, torch-free, so that the config can offer them without importing torch
(``klgrpo train --help`` and config errors stay instant). :data:`klgrpo.math.policy_loss.POLICY_LOSSES` registers
exactly these names, in this order, and refuses to import otherwise: this tuple is the one list of names."""

POLICY_LOSS_NAMES = ("ppo_clip", "gspo", "cispo")

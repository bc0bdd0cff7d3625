"""Metric names in both directions: every name a run logs is in the glossary and in docs/metrics.md, and every
name docs/metrics.md documents is a glossary name that a run with the optional metrics switched on logs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from klgrpo.run.metrics import describe, read_metrics
from klgrpo.run.trainer import GRPOTrainer
from klgrpo.train import metric_names as m
from tests.conftest import write_jsonl
from tests.helpers.configs import HAS_ZERO, make_config, quiet
from tests.helpers.reward_model import build_reward_model, rm_tokenizer, save_reward_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
# A time-bounded reward (as math_verify): every other completion "ran out of time".
BOUNDED_REWARD = """
from klgrpo.core.rewards.builtins import TimedScores

def bounded(prompts, completions, **kw):
    return TimedScores([0.0] * len(completions), [i % 2 == 0 for i in range(len(completions))])
"""

def documented_names() -> set[str]:
    """The names in the first column of docs/metrics.md's "| name | formula / meaning |" tables (a cell
    `a`, `b`, `c` lists several)."""
    names, in_table = set(), False
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 3:
            in_table = False
        elif cells[1] == "name":
            in_table = True
        elif in_table:
            names.update(re.findall(r"`([^`]+)`", cells[1]))
    return names


def _is_documented_in_docs(name: str, documented: set[str]) -> bool:
    if name in documented:
        return True
    return any("<" in d and name.startswith(d[: d.index("<")]) for d in documented)


@pytest.fixture(scope="module")
def logged(tiny_model_dir, addition_file, tmp_path_factory):
    """Every name two short runs log with the optional metrics switched on: the KL in the loss and the reward,
    the clip shaping, the replay anchor, an evaluation set, a reward model and a custom loss that returns a
    metric; then the entropy bonus, the top-entropy and the off-policy masks under truncated sampling (top-p);
    then a step generated ahead (rollout.max_staleness)."""
    tokenizer = rm_tokenizer()
    reward_model = save_reward_model(tmp_path_factory.mktemp("rm"), build_reward_model(tokenizer), tokenizer)
    replay_file = write_jsonl(tmp_path_factory.mktemp("replay") / "sub.jsonl",
                              [{"prompt": f"{a:02d}-{b:02d}="} for a in range(50, 90, 7) for b in range(0, 40, 13)])
    out = tmp_path_factory.mktemp("names")
    (out / "bounded.py").write_text(BOUNDED_REWARD)
    cfg = make_config(tiny_model_dir, addition_file, out / "run", train={"steps": 1},
                      kl={"coef": 0.1, "placement": "both", "shaping": "clip",
                          "replay": {"coef": 1.0, "source": str(replay_file), "num_prompts": 4,
                                     "completions_per_prompt": 1, "batch_size": 4}},
                      eval={"sets": [{"name": "add", "source": str(addition_file), "limit": 4}]},
                      rewards={"functions": [HAS_ZERO, {"model": reward_model},
                                             {"name": f"{out / 'bounded.py'}:bounded"}]})

    def custom_loss(inp):
        loss = -(inp.advantages.unsqueeze(-1) * inp.logp * inp.mask).sum() / inp.normalizer.num_sequences
        return loss, {"token_count": inp.mask.sum().float()}

    trainer = GRPOTrainer(cfg, loss_fn=custom_loss, log=quiet)
    trainer.train()
    # the entropy bonus and the masks shape the built-in objective only: a second run without the custom loss
    entropy_cfg = make_config(tiny_model_dir, addition_file, out / "entropy", train={"steps": 2, "num_iterations": 2},
                              loss={"entropy_coef": 0.01, "top_entropy_quantile": 0.5,
                                    "off_policy_mask_threshold": 0.05}, rollout={"top_p": 0.9})
    entropy_run = GRPOTrainer(entropy_cfg, log=quiet)
    entropy_run.train()
    # generation while training logs the batch's staleness
    ahead = make_config(tiny_model_dir, addition_file, out / "ahead", train={"steps": 1},
                        rollout={"max_staleness": 1, "sampler": "kv_loop"})
    GRPOTrainer(ahead, log=quiet).train()
    rows = [*read_metrics(trainer.run_dir), *read_metrics(entropy_run.run_dir), *read_metrics(out / "ahead")]
    return {k for row in rows for k in row} - {"step", "wall_time"}


def test_every_logged_name_is_in_the_glossary_and_the_docs(logged):
    documented = documented_names()
    assert {m.LOSS, m.KL_REPLAY, m.KL_SHAPING_CLIP_FRAC, m.eval_set("add"), m.custom("token_count"),
            m.TIME_REWARD_MODEL, m.REWARD_TIMEOUTS_PREFIX + "bounded"} <= logged
    assert [n for n in sorted(logged) if describe(n) is None] == []
    assert [n for n in sorted(logged) if not _is_documented_in_docs(n, documented)] == []


def test_every_documented_name_is_a_glossary_name_and_is_logged(logged):
    documented = documented_names()
    assert len(documented) >= 40  # the parser read the tables
    assert sorted(documented - set(m.GLOSSARY)) == []
    assert sorted(set(m.GLOSSARY) - documented) == []
    never = [d for d in sorted(documented) if not any(_is_documented_in_docs(n, {d}) for n in logged)]
    assert never == []


def test_the_checks_fail_on_an_undocumented_name():
    """The planted case: a name nobody documented is caught by both checks."""
    assert describe("kl/k4") is None
    assert not _is_documented_in_docs("kl/k4", documented_names())
    assert _is_documented_in_docs(m.reward_function("exact_match"), documented_names())


def test_constants_spell_the_glossary_names():
    constants = {v for k, v in vars(m).items() if k.isupper() and isinstance(v, str)}
    constants |= set(m.SAMPLER_QUARTILE_NAMES)  # a family spelled by sampler_quartile
    assert constants - {m.REWARD_PREFIX, m.EVAL_PREFIX, m.CUSTOM_PREFIX, m.REWARD_TIMEOUTS_PREFIX} == set(m.GLOSSARY)

"""CONTRIBUTING.md's recipes, run as written: each code block is the ONE edit that adds an extension, so after
executing it in its module the config accepts the new name and the math runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from klgrpo.apps.args import parse_args
from klgrpo.config.fields import setting
from klgrpo.config.schema import GRPOConfig, KLConfig
from klgrpo.config.terms import controller_params, step_plan
from klgrpo.errors import ConfigError
from klgrpo.integrations.mapping import drop_unread_kl_keys
from klgrpo.math import kl, kl_control, policy_loss
from klgrpo.math.aggregation import Normalizer
from klgrpo.math.objective import KLTerm, ObjectiveInputs, ObjectiveTerms, PolicyTerm, grpo_objective

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"


def recipe(heading: str) -> str:
    """The first python block under ``heading``."""
    text = CONTRIBUTING.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_in(module, code: str, registry, name: str):
    """Execute ``code`` as if it were written in ``module``; return the registered entry (removed afterwards by
    the caller through ``registry._items.pop``)."""
    namespace = dict(vars(module))
    exec(compile(code, f"CONTRIBUTING.md ({module.__name__})", "exec"), namespace)
    return registry[name]


def test_the_estimator_recipe_registers_a_checked_estimator():
    entry = run_in(kl, recipe("### Adding an estimator"), kl.ESTIMATORS, "k2_half")
    try:
        cfg, _ = parse_args(["--kl.estimator", "k2_half"])
        assert cfg.kl.estimator == "k2_half"
        l = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
        (grad,) = torch.autograd.grad(entry.fn(l).sum(), l)
        torch.testing.assert_close(grad, entry.score_factor(l.detach()))  # d(l^2/4)/dl = l/2
        assert entry.fn(torch.tensor(2.0)).item() == 1.0  # 2^2 / 4
    finally:
        kl.ESTIMATORS._items.pop("k2_half")


def test_the_policy_loss_recipe_is_selected_by_name():
    run_in(policy_loss, recipe("### Adding a policy loss"), policy_loss.POLICY_LOSSES, "reinforce")
    try:
        cfg, _ = parse_args(["--loss.policy_loss", "reinforce"])
        assert cfg.loss.policy_loss == "reinforce"
        logp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
        inputs = ObjectiveInputs(logp, logp.detach(), None, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2))
        out = grpo_objective(inputs, ObjectiveTerms(kl=KLTerm(), aggregation="token_mean",
                                                    policy=PolicyTerm(name="reinforce")),
                             Normalizer.of(torch.ones(1, 2)))
        assert float(out.loss.detach()) == pytest.approx(-2.0 * (-0.5 - 1.0) / 2)  # -A * mean log pi = 1.5
    finally:
        policy_loss.POLICY_LOSSES.unregister("reinforce")


def test_the_policy_loss_recipe_gets_its_own_setting_from_the_config_checked_against_its_declaration():
    """The one edit of the recipe is all it takes: loss.policy_params reaches the function through the step's
    PolicyTerm, and the bound declared on the setting refuses a bad value in one line."""
    run_in(policy_loss, recipe("### Adding a policy loss"), policy_loss.POLICY_LOSSES, "reinforce")
    base = ["--data.source", "x.jsonl", "--model.name_or_path", "m", "--loss.policy_loss", "reinforce"]
    try:
        cfg, _ = parse_args([*base, "--loss.policy_params", "{scale: 2.0}"])
        cfg.validate()
        term = step_plan(cfg).policy
        assert term.params == policy_loss.POLICY_LOSSES.params("reinforce")(scale=2.0)
        logp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
        inputs = ObjectiveInputs(logp, logp.detach(), None, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2))
        out = grpo_objective(inputs, ObjectiveTerms(kl=KLTerm(), aggregation="token_mean", policy=term),
                             Normalizer.of(torch.ones(1, 2)))
        assert float(out.loss.detach()) == pytest.approx(3.0)  # -2 * A * mean log pi = -2 * 2 * (-0.75)
        with pytest.raises(ConfigError, match=r"^loss.policy_params.scale must be > 0, got 0$"):
            parse_args([*base, "--loss.policy_params", "{scale: 0}"])[0].validate()
        with pytest.raises(ConfigError, match=r"^loss.policy_params.sacle: loss.policy_loss reinforce has the "
                                              r"settings scale$"):
            parse_args([*base, "--loss.policy_params", "{sacle: 2}"])[0].validate()
    finally:
        policy_loss.POLICY_LOSSES.unregister("reinforce")


def test_the_controller_recipe_gets_its_settings_from_the_config():
    cls = run_in(kl_control, recipe("### Adding a controller"), kl_control.CONTROLLERS, "proportional")
    try:
        cfg, _ = parse_args(["--kl.controller", "proportional", "--kl.coef", "0.5", "--kl.target", "0.1",
                             "--kl.dual_lr", "0.2"])
        params = controller_params(cfg.kl)
        assert params == {"target": 0.1, "dual_lr": 0.2, "beta_min": 0.0, "kl_measure": "token_mean"}
        ctl = kl_control.build_controller("proportional", cfg.kl.coef, **params)
        assert isinstance(ctl, cls)
        assert ctl.update(0.2) == pytest.approx(0.5 * (1 + 0.2 * (0.2 - 0.1) / 0.1))  # 0.6
    finally:
        kl_control.CONTROLLERS._items.pop("proportional")


def test_a_controller_with_a_new_setting_needs_only_its_class_and_one_field_declaration():
    """The recipe's second edit, as CONTRIBUTING.md writes it: one declared KLConfig field; its keyword is handed
    over, its bound checked, and the mappings keep it only for the controller that takes it."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("### Adding a controller"):]
    declaration = re.search(r"`(floor: float = _f\(.*?\))`", section, re.S).group(1)
    namespace = {"_f": setting, "KLConfig": KLConfig, "dataclass": dataclass}
    exec(f"@dataclass\nclass KLWithFloor(KLConfig):\n    {declaration}\n", namespace)
    kl_with_floor = namespace["KLWithFloor"]
    proportional = run_in(kl_control, recipe("### Adding a controller"), kl_control.CONTROLLERS, "proportional")

    @kl_control.CONTROLLERS.register("floored")
    class Floored(proportional):
        def __init__(self, init_coef, target, dual_lr=0.1, floor=0.0, kl_measure="token_mean"):
            super().__init__(init_coef, target, dual_lr, floor, kl_measure)

    try:
        kl = kl_with_floor(controller="floored", coef=0.31, target=0.1, floor=0.3)
        params = controller_params(kl)
        assert params == {"target": 0.1, "dual_lr": 0.1, "floor": 0.3, "kl_measure": "token_mean"}
        ctl = kl_control.build_controller("floored", kl.coef, **params)
        assert ctl.update(0.0) == pytest.approx(0.3)  # 0.31 * (1 + 0.1 * (0 - 0.1) / 0.1) = 0.279, floored at 0.3
        with pytest.raises(ConfigError, match=r"^kl.floor must be >= 0, got -1.0$"):
            GRPOConfig(kl=kl_with_floor(controller="floored", floor=-1.0)).validate()
        with pytest.raises(ConfigError, match=r"^kl.target must be > 0 for kl.controller=floored$"):
            GRPOConfig(kl=kl_with_floor(controller="floored", target=0.0)).validate()
        mapped = {"kl.controller": "floored", "kl.floor": 0.3, "kl.target": 0.1, "kl.horizon": 10000.0}
        drop_unread_kl_keys(mapped)
        assert mapped == {"kl.controller": "floored", "kl.floor": 0.3, "kl.target": 0.1}
        mapped = {"kl.controller": "fixed", "kl.floor": 0.3, "kl.target": 0.1, "kl.kl_measure": "token_mean"}
        drop_unread_kl_keys(mapped)
        assert mapped == {"kl.controller": "fixed", "kl.kl_measure": "token_mean"}
    finally:
        kl_control.CONTROLLERS._items.pop("floored")
        kl_control.CONTROLLERS._items.pop("proportional")


def test_the_sampler_recipe_registers_a_sampler_a_run_opens():
    """The backend recipe, run in backends/samplers.py: rollout.sampler accepts the name, pick_sampler opens a new
    instance of the class, and a rollout through it gives the KV loop's tokens and log-probs."""
    from klgrpo.backends import samplers
    from klgrpo.config.schema import GRPOConfig as Config
    from klgrpo.core.rollout import SamplingParams
    from klgrpo.core.rollout import generate_groups as groups
    from tests.test_rollout_sampler import _llama

    cls = run_in(samplers, recipe("## Adding a backend"), samplers.SAMPLERS, "my_sampler")
    try:
        assert Config.from_dict({"rollout": {"sampler": "my_sampler"}}).rollout.sampler == "my_sampler"
        model = _llama()
        opened, why = samplers.pick_sampler("my_sampler", model)
        assert type(opened) is cls and why == "rollout.sampler"

        class Tok:  # the two calls a rollout makes of a tokenizer, on token ids written as text
            pad_token_id, eos_token_id, chat_template = 0, 1, None

            def __call__(self, texts, return_tensors=None, padding=False):
                rows = [[int(t) for t in text.split()] for text in texts]
                width = max(map(len, rows))
                ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
                return {"input_ids": ids, "attention_mask": (ids != 0).long()}

            def batch_decode(self, rows, skip_special_tokens=True):
                return [" ".join(map(str, r)) for r in rows]

        params = SamplingParams(group_size=2, max_new_tokens=4, temperature=0.9)
        torch.manual_seed(0)
        mine = groups(model, Tok(), ["5 6 7", "3 4"], SamplingParams(**{**params.__dict__, "sampler": opened}))
        torch.manual_seed(0)
        loop = groups(model, Tok(), ["5 6 7", "3 4"], SamplingParams(**{**params.__dict__, "sampler": "kv_loop"}))
        assert torch.equal(mine.completion_ids, loop.completion_ids)
        assert torch.equal(mine.sampler_logp, loop.sampler_logp)
    finally:
        samplers.SAMPLERS.unregister("my_sampler")

"""``klgrpo explain`` on NeMo-RL GRPO configs, by release (klgrpo/apps/explain/nemo_rl.json, read by hand from
NVIDIA-NeMo/RL's ClippedPGLossFn and calculate_kl at every tag v0.1.0 - v0.7.0 and main).

Each expected verdict is derived by hand from the loss at the release (l = log pi - log ref, r = ref / pi,
s = grad log pi, beta = reference_policy_kl_penalty):
- before 0.7.0 the loss adds beta x k3 (k3 = r - 1 - log r), times ones (or, with use_on_policy_kl_approximation,
  the DETACHED exp(logp - generation_logp)): grad k3 = (1 - r) s, whose mean under pi is grad KL(ref||pi):
  "forward" (a detached weight rescales samples, never the direction); k1 = l unweighted: grad l = s, mean 0:
  "zero"; k2 = l^2 / 2 unweighted: l s, mean grad KL(pi||ref): "reverse";
- from 0.7.0 the weight is in the graph: exp(logp - logp.detach()) (1 in value) adds k s to the gradient: k3 gives
  (k3 + 1 - r) s = -log r s = l s: "reverse" on the first update; k2 gives (l^2 / 2 + l) s: "neither";
- the estimate is clamped to 10 from 0.5.0 (kl_output_clamp_value): the clip risk; the loss is a token mean
  (token_level_loss true): the sequence verdict of a KL in the loss is "neither".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from klgrpo.apps.explain import main
from klgrpo.apps.explain.frameworks import releases, split_option
from klgrpo.config.schema import GRPOConfig

DATA = Path(__file__).resolve().parent / "data" / "explain_nemo_rl"
#: explain's risk ids (its JSON's risk_ids) -> the short names the expectations below use
RISKS = {"beta_zero": "beta0", "forward_kl": "forward", "kl_clipped": "clip", "neither_kl": "neither", "zero_kl":
         "zero", "off_policy": "offpolicy"}


def _run(tmp_path, text=None, name="cfg.yaml", extra=(), source=None):
    src = source or tmp_path / name
    if source is None:
        src.write_text(text)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.json')))}.json"
    status = main([str(src), "--json", str(out), *extra])
    return status, (json.loads(out.read_text()) if status == 0 else None)


def _kinds(risk_ids: list[str]) -> set[str]:
    return {RISKS[i] for i in risk_ids if i in RISKS}


def _answers(report):
    return [(v["releases"], v["gradient"]["token_on_policy"], v["gradient"]["sequence_on_policy"], v["controller"])
            for v in report.get("versions", [report])]


def test_the_table_holds_every_release_read():
    rows = releases("nemo_rl")
    assert [r.release["from"] for r in rows] == ["0.1.0", "0.2.0", "0.2.1", "0.4.0", "0.5.0", "0.6.0", "0.7.0"]
    assert all(r.release["read"] for r in rows)
    by = {r.release["from"]: r.release for r in rows}
    assert (by["0.6.0"]["weight"], by["0.6.0"]["on_policy_weight"]) == ("none", "detached")
    assert (by["0.7.0"]["weight"], by["0.7.0"]["on_policy_weight"]) == ("unit_in_graph", "in_graph")
    assert by["0.4.0"]["input_clamp"] == 20.0 and by["0.2.1"]["input_clamp"] is None
    assert by["0.1.0"]["package"] == "nemo_reinforcer" and by["0.2.1"]["package"] == "nemo_rl"
    assert split_option("nemo_rl==0.7.0;verl==0.3") == ("verl==0.3", {"nemo_rl": split_option("nemo-rl==0.7.0")[1][
        "nemo_rl"]})


# file: (--version, token, sequence, beta rule, risks, klgrpo kl keys)
REAL = {
    # v0.3.0's grpo_math_1B.yaml: k3 at 0.01 times ones (use_on_policy_kl_approximation false), no clamp, token
    # mean, 32 x 16 = 512 samples in one update of 512: forward, on policy.
    "v0.3.0_grpo_math_1B.yaml": ("nemo_rl==0.3.0", "forward", "neither", "fixed at 0.01", {"forward"},
                                 {"coef": 0.01, "estimator": "k3", "is_correction": "none", "shaping": "none"}),
    # v0.7.0's: the same k3 at 0.01, weighed by exp(logp - logp.detach()): reverse; clamped at 10.
    "v0.7.0_grpo_math_1B.yaml": ("nemo_rl==0.7.0", "reverse", "neither", "fixed at 0.01", {"clip"},
                                 {"coef": 0.01, "estimator": "k3", "is_correction": "in_graph", "shaping": "clip",
                                  "clip_threshold": 10.0}),
    # a recipe (defaults: ../../grpo_math_1B.yaml) with use_on_policy_kl_approximation true: exp(logp -
    # generation_logp) in the graph, klgrpo's in_graph: reverse; the rest inherited (k3, 0.01, clamp 10).
    "v0.7.0_grpo-dapomath17k-dsv3-megatron.yaml": ("nemo_rl==0.7.0", "reverse", "neither", "fixed at 0.01", {"clip"},
                                                   {"coef": 0.01, "estimator": "k3", "is_correction": "in_graph"}),
    # a recipe at beta 0.001 (it inherits another recipe, not stored here: named; the rest read as
    # grpo_math_1B.yaml's; tests/test_explain_fresh_files.py reads such a chain with its parent beside it).
    "v0.7.0_grpo-deepscaler-1.5b-16K.yaml": ("nemo_rl==0.7.0", "reverse", "neither", "fixed at 0.001", {"clip"},
                                             {"coef": 0.001, "estimator": "k3", "is_correction": "in_graph"}),
}


def test_every_real_file_is_listed_with_its_source_and_licence():
    rows = [line.split(" | ") for line in (DATA / "SOURCES").read_text().splitlines() if line.strip()]
    assert {row[0] for row in rows} == {p.name for p in DATA.glob("*.yaml")} == set(REAL)
    assert all(row[1] == "NVIDIA-NeMo/RL" and row[4] == "Apache-2.0" for row in rows)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_file_verdict(name, tmp_path, capsys):
    version, token, sequence, beta, risks, kl = REAL[name]
    status, report = _run(tmp_path, source=DATA / name, extra=["--version", version])
    assert status == 0, capsys.readouterr().err
    assert report["source"] == "nemo_rl" and "versions" not in report
    assert (report["gradient"]["token_on_policy"], report["gradient"]["sequence_on_policy"]) == (token, sequence)
    assert report["controller"] == beta
    assert _kinds(report["risk_ids"]) == risks and len(report["risk_ids"]) == len(risks), report["risk_ids"]
    assert {k: report["config"]["kl"][k] for k in kl} == kl
    assert report["config"]["loss"]["aggregation"] == "token_mean"
    GRPOConfig.from_dict(report["config"]).validate()


def test_real_file_without_a_release_gets_each_range_answer(tmp_path, capsys):
    # v0.7.0's file sets use_kl_in_reward (0.6.0 on) and reference_policy_kl_type (0.5.0 on): 0.6 and 0.7 remain
    status, report = _run(tmp_path, source=DATA / "v0.7.0_grpo_math_1B.yaml")
    assert status == 0
    assert _answers(report) == [(["NeMo-RL 0.7.0 or later"], "reverse", "neither", "fixed at 0.01"),
                                (["NeMo-RL >= 0.6.0, < 0.7.0"], "forward", "neither", "fixed at 0.01")]
    last = capsys.readouterr().out.splitlines()[-1]
    assert "which do you run?" in last and "--version nemo_rl==0.7.0" in last
    # v0.3.0's sets neither: every range from 0.2.1 (token_level_loss) answers
    status, report = _run(tmp_path, source=DATA / "v0.3.0_grpo_math_1B.yaml")
    assert _answers(report) == [(["NeMo-RL 0.7.0 or later"], "reverse", "neither", "fixed at 0.01"),
                                (["NeMo-RL >= 0.5.0, < 0.7.0"], "forward", "neither", "fixed at 0.01"),
                                (["NeMo-RL >= 0.2.1, < 0.5.0"], "forward", "neither", "fixed at 0.01")]


def test_the_recipe_names_the_config_it_inherits(tmp_path):
    status, report = _run(tmp_path, source=DATA / "v0.7.0_grpo-deepscaler-1.5b-16K.yaml",
                          extra=["--version", "nemo_rl==0.7.0"])
    assert report["unmapped"]["defaults"].startswith("grpo-deepscaler-1.5b-8K.yaml: the config it inherits is not "
                                                     "beside the file, not read")
    status, report = _run(tmp_path, source=DATA / "v0.7.0_grpo-dapomath17k-dsv3-megatron.yaml",
                          extra=["--version", "nemo_rl==0.7.0"])
    assert "defaults" not in report["unmapped"]  # grpo_math_1B.yaml: the defaults explain takes
    assert report["unmapped"]["loss_fn.use_importance_sampling_correction"].startswith(
        "weights the policy term by pi_old / pi_generation")


@pytest.mark.parametrize("version, kl_type, token", [
    ("0.5.0", "k1", "zero"), ("0.5.0", "k2", "reverse"), ("0.5.0", "k3", "forward"),
    ("0.7.0", "k1", "reverse"), ("0.7.0", "k2", "neither"), ("0.7.0", "k3", "reverse")])
def test_each_estimator_by_release(tmp_path, version, kl_type, token):
    text = f"loss_fn:\n  reference_policy_kl_penalty: 0.05\n  reference_policy_kl_type: {kl_type}\n"
    status, report = _run(tmp_path, text, extra=["--version", f"nemo_rl=={version}"])
    assert status == 0 and report["gradient"]["token_on_policy"] == token
    assert report["config"]["kl"]["estimator"] == kl_type


def test_the_on_policy_approximation_is_detached_before_0_7(tmp_path):
    text = "loss_fn:\n  use_on_policy_kl_approximation: true\n"
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.4.0"])
    assert report["gradient"]["token_on_policy"] == "forward" and report["config"]["kl"]["is_correction"] == \
        "detached"
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.7.0"])
    assert report["gradient"]["token_on_policy"] == "reverse" and report["config"]["kl"]["is_correction"] == \
        "in_graph"
    # 0.1.0 has no such key: the range is ruled out
    assert main([str(tmp_path / "cfg.yaml"), "--version", "nemo_rl==0.1.0"]) == 2


def test_several_updates_with_the_unit_weight_name_the_difference(tmp_path):
    text = ("grpo:\n  num_prompts_per_step: 32\n  num_generations_per_prompt: 16\n"
            "policy:\n  train_global_batch_size: 128\n")
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.7.0"])
    assert report["off_policy"]
    assert report["unmapped"]["policy.train_global_batch_size"].startswith("4 updates per step")
    assert report["unmapped"]["loss_fn.use_on_policy_kl_approximation"].startswith(
        "false: NeMo-RL 0.7.0 or later weighs the KL by exp(logp - logp.detach()), 1 in value on every update")


def test_kl_in_reward(tmp_path, capsys):
    text = "loss_fn:\n  reference_policy_kl_penalty: 0.02\n  use_kl_in_reward: true\n"
    # 0.7.0: the loss's beta is 0, and the GRPO estimator adds no KL: no KL term at all
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.7.0"])
    assert report["gradient"]["token_on_policy"] == "zero" and _kinds(report["risk_ids"]) == {"beta0"}
    assert "no KL term is left" in report["unmapped"]["loss_fn.use_kl_in_reward"]
    # 0.6.0: only Reinforce++ reads it; the loss keeps beta x k3 (unweighted: forward)
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.6.0"])
    assert report["gradient"]["token_on_policy"] == "forward" and report["controller"] == "fixed at 0.02"
    # Reinforce++: the KL in each token's advantage, no counterpart: one line, exit 2
    rpp = text + "grpo:\n  adv_estimator:\n    name: reinforce_plus_plus\n"
    capsys.readouterr()
    assert main([str(_write(tmp_path, "rpp.yaml", rpp)), "--version", "nemo_rl==0.7.0"]) == 2
    assert "klgrpo has no such placement" in capsys.readouterr().err


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_refusals(tmp_path, capsys):
    for text, said in (("loss_fn:\n  reference_policy_kl_type: k4\n", "none of NeMo-RL 0.7.0 or later's"),
                       ("loss_fn:\n  reference_policy_kl_penalty: .nan\n", "must be a finite number"),
                       ("loss_fn:\n  reference_policy_kl_type: k3\n", "is not a key of NeMo-RL >= 0.4.0, < 0.5.0")):
        path = _write(tmp_path, "bad.yaml", text)
        version = "nemo_rl==0.4.0" if "k3\n" in text else "nemo_rl==0.7.0"
        assert main([str(path), "--version", version]) == 2
        assert said in capsys.readouterr().err
    assert main([str(path), "--version", "nemo_rl==0.0.1"]) == 2
    assert "outside every NeMo-RL release range" in capsys.readouterr().err


def test_write_carries_the_sampling_filter(tmp_path):
    text = "loss_fn:\n  reference_policy_kl_penalty: 0.01\npolicy:\n  generation:\n    top_p: 0.9\n    top_k: 50\n"
    out = tmp_path / "k.yaml"
    status, report = _run(tmp_path, text, extra=["--version", "nemo_rl==0.7.0", "--write", str(out)])
    assert status == 0
    assert report["unmapped"]["policy.generation"].startswith(
        "top_p 0.9, top_k 50: a sampling filter; NeMo-RL's policy term scores the filtered distribution and its KL "
        "the full softmax")
    written = yaml.safe_load(out.read_text())
    assert (written["rollout"]["top_p"], written["rollout"]["top_k"], written["rollout"]["truncation"]) == (
        0.9, 50, "policy")
    assert written["kl"]["estimator"] == "k3" and written["kl"]["is_correction"] == "in_graph"

"""``klgrpo explain --run`` reads the sampler-to-trainer panel: a klgrpo run's sampler/* metrics and verl's
rollout_corr/* ones, with the steps beyond klgrpo's warning bands (ESS below 0.9, chi-square above 1)."""

from __future__ import annotations

import json

from klgrpo.apps.explain import main
from tests.test_explain_run_trackers import _tensorboard


def _klgrpo_rows(ess, chi2):
    return [{"step": s, "wall_time": 0.1 * s, "adaptive_kl/raw_kl": 0.01 * s, "adaptive_kl/current_beta": 0.04,
             "sampler/kl_k3": 0.001 * s, "sampler/ess": e, "sampler/chi2_token": c,
             "sampler/masked_token_frac": 0.0} for s, (e, c) in enumerate(zip(ess, chi2), start=1)]


def test_a_klgrpo_run_whose_sampler_drifted(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = _klgrpo_rows([0.99, 0.9, 0.6, 0.45, 0.3, 0.2], [0.01, 0.1, 0.5, 0.9, 1.5, 3.0])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run.json"
    assert main(["--run", str(run), "--json", str(out)]) == 0
    panel = json.loads(out.read_text())["sampler"]
    assert panel["ess"]["below_band"] == [3, 4, 5, 6] and panel["ess"]["min"] == 0.2  # 0.9 is not below 0.9
    assert panel["chi2_token"]["above_band"] == [5, 6] and panel["chi2_token"]["max"] == {"step": 6, "value": 3.0}
    assert panel["kl"]["metric"] == "sampler/kl_k3" and panel["bands"] == {"warn_ess_below": 0.9,
                                                                             "warn_chi2_above": 1.0}
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  sampler:")]
    assert "below 0.9 at 4 of 6 steps (from step 3)" in line and "above 1 at 2 steps (from step 5)" in line
    assert line.endswith("(docs/kl_guide.md)")


def test_a_matched_sampler_and_a_run_without_the_panel(tmp_path, capsys):
    matched, plain = tmp_path / "matched", tmp_path / "plain"
    without = [{"step": s, "wall_time": 0.1 * s, "adaptive_kl/raw_kl": 0.01 * s} for s in range(1, 5)]
    for folder, rows in ((matched, _klgrpo_rows([1.0] * 4, [0.0] * 4)), (plain, without)):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "m.json"
    assert main(["--run", str(matched), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["sampler"]["ess"]["below_band"] == []
    assert "the sampler stayed with the trainer" in capsys.readouterr().out
    other = tmp_path / "p.json"  # explain never overwrites a file it was not told to
    assert main(["--run", str(plain), "--json", str(other)]) == 0
    assert json.loads(other.read_text())["sampler"] is None
    assert "  sampler:" not in capsys.readouterr().out


def test_verl_rollout_correction_metrics(tmp_path):
    """verl logs its rollout-correction diagnostics as rollout_corr/* beside the actor's metrics."""
    folder = tmp_path / "tensorboard_log" / "proj" / "exp"
    rows = [(step, {"actor/kl_loss": 0.001 * step, "actor/kl_coef": 0.001, "actor/pg_loss": -0.5,
                    "rollout_corr/kl": 0.002, "rollout_corr/rollout_is_eff_sample_size": 0.9 - 0.1 * step,
                    "rollout_corr/chi2_token": 0.2 * step}) for step in range(1, 7)]
    _tensorboard(folder, rows)
    out = tmp_path / "v.json"
    assert main(["--run", str(tmp_path / "tensorboard_log"), "--json", str(out)]) == 0
    panel = json.loads(out.read_text())["sampler"]
    assert panel["ess"]["metric"] == "rollout_corr/rollout_is_eff_sample_size"
    assert panel["ess"]["below_band"] == [1, 2, 3, 4, 5, 6]  # 0.8 down to 0.3
    assert panel["chi2_token"]["above_band"] == [6]  # 1.2

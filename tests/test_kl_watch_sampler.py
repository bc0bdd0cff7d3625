"""The sampler's warning sign on known traces: windows, both bands, once per entry, its state across a resume."""

from __future__ import annotations

from klgrpo.run.kl_watch import SamplerWatch


def test_a_window_below_the_ess_band_warns_once_until_it_leaves():
    watch = SamplerWatch(ess_below=0.5, chi2_above=0.0, window=2)
    # windows: (0.9, 0.7) mean 0.8 | (0.4, 0.5) mean 0.45 | (0.3, 0.2) mean 0.25 | (0.9, 0.9) | (0.1, 0.1)
    trace = [0.9, 0.7, 0.4, 0.5, 0.3, 0.2, 0.9, 0.9, 0.1, 0.1]
    lines = {step: watch.observe(step, ess, 0.0) for step, ess in enumerate(trace, start=1)}
    warned = [step for step, said in lines.items() if said]
    assert warned == [4, 10]  # entered at the second window, left at the fourth, entered again at the fifth
    assert "sampler/ess 0.45 below rollout.warn_ess_below 0.5 (mean of steps 3-4)" in lines[4][0]


def test_the_chi_square_band_and_both_at_once():
    watch = SamplerWatch(ess_below=0.5, chi2_above=1.0, window=1)
    assert watch.observe(1, 0.9, 2.0)[0].count("above rollout.warn_chi2_above 1") == 1
    watch = SamplerWatch(ess_below=0.5, chi2_above=1.0, window=1)
    both = watch.observe(1, 0.3, 2.0)[0]
    assert "sampler/ess 0.3 below" in both and "sampler/chi2_token 2 above" in both
    assert SamplerWatch(0.0, 0.0, 1).observe(1, 0.0, 100.0) == []  # both bands off


def test_steps_without_the_panel_are_not_counted_and_the_state_resumes():
    watch = SamplerWatch(ess_below=0.5, chi2_above=0.0, window=2)
    assert watch.observe(1, None, None) == [] and watch.observe(2, 0.2, 0.0) == []
    resumed = SamplerWatch(ess_below=0.5, chi2_above=0.0, window=2)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.observe(3, 0.2, 0.0) and not watch.observe(3, float("nan"), 0.0)

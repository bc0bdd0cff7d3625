"""The KL warning signs: windows, bands and announcements on scripted KL sequences (means by hand), the
defaults' bands, and a run that writes the console line and the TensorBoard text entry."""

from __future__ import annotations

import pytest

from klgrpo.config.schema import GRPOConfig
from klgrpo.run.kl_watch import KLWatch
from klgrpo.run.trainer import GRPOTrainer
from tests.helpers.configs import make_config, quiet


def _feed(watch: KLWatch, kls: list[float]) -> dict[int, list[str]]:
    return {step: lines for step, kl in enumerate(kls, start=1) if (lines := watch.observe(step, kl))}


def test_defaults_are_the_tutorial_bands():
    kl = GRPOConfig().kl
    assert (kl.warn_above, kl.warn_below, kl.warn_window) == (0.2, 0.01, 20)


def test_drifting_needs_above_and_rising_and_is_announced_once():
    watch = KLWatch(warn_above=0.2, warn_below=0.0, window=2)
    # window means: (0.1+0.3)/2 = 0.2 (not above), (0.25+0.35)/2 = 0.3 (above, rising from 0.2), 0.4 (still in:
    # silent), 0.3 (above but falling: out), 0.5 (rising again: announced again)
    out = _feed(watch, [0.1, 0.3, 0.25, 0.35, 0.4, 0.4, 0.3, 0.3, 0.5, 0.5])
    assert sorted(out) == [4, 10]
    assert "step 4" in out[4][0] and "0.3 per token (mean of steps 3-4)" in out[4][0]
    assert "previous window 0.2" in out[4][0] and "kl.warn_above 0.2" in out[4][0] and "drifting" in out[4][0]
    # the first window rises from the reference's KL of 0, as the runaway guard judges it (one window collector)
    first = _feed(KLWatch(0.2, 0.0, 2), [0.9, 0.9])
    assert list(first) == [2] and "rising (previous window 0)" in first[2][0]


def test_one_window_collector_for_every_judge():
    """The warning signs, the runaway guard, the controller's reach and explain's bands read the same windows."""
    from klgrpo.apps.explain import run_logs
    from klgrpo.run import kl_watch, runaway

    assert runaway.WindowMeans is kl_watch.WindowMeans and run_logs.WindowMeans is kl_watch.WindowMeans
    windows = kl_watch.WindowMeans(2)
    done = [w for s, v in enumerate([0.1, 0.3, 0.5, 0.7], 1) if (w := windows.observe(s, v)) is not None]
    assert [(w.first_step, w.last_step, w.index) for w in done] == [(1, 2, 0), (3, 4, 1)]
    assert [w.previous for w in done] == [0.0, pytest.approx(0.2)] and done[1].mean == pytest.approx(0.6)
    resumed = kl_watch.WindowMeans(2)
    resumed.load_state_dict(windows.state_dict())
    assert resumed.observe(5, 0.0) is None and resumed.observe(6, 0.0).index == 2


def test_not_learning_skips_the_first_window():
    watch = KLWatch(warn_above=0.0, warn_below=0.01, window=3)
    # window means: 0 (first window: the run starts at the reference), 0.005 (below: announced), 0.02 (out), 0.002
    out = _feed(watch, [0, 0, 0, 0.005, 0.005, 0.005, 0.02, 0.02, 0.02, 0.002, 0.002, 0.002])
    assert sorted(out) == [6, 12]
    assert "0.005 per token (mean of steps 4-6)" in out[6][0] and "not learning" in out[6][0]


def test_off_and_state_round_trip():
    assert _feed(KLWatch(0.0, 0.0, 1), [5.0, 0.0, 9.0]) == {}
    a, b = KLWatch(0.2, 0.01, 2), KLWatch(0.2, 0.01, 2)
    _feed(a, [0.1, 0.3, 0.25])  # mid-window
    b.load_state_dict(a.state_dict())
    assert a.observe(4, 0.35) == b.observe(4, 0.35) != []


def test_bands_are_validated():
    from klgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kl.warn_below \(0.3\) must be below kl.warn_above \(0.2\)"):
        GRPOConfig.from_dict({"kl": {"warn_below": 0.3}, "data": {"source": "x.jsonl"}}).validate()
    with pytest.raises(ConfigError, match="kl.warn_window must be >= 1"):
        GRPOConfig.from_dict({"kl": {"warn_window": 0}}).validate()


def test_a_sign_reaches_the_console_and_tensorboard(tiny_model_dir, addition_file, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 3},
                      kl={"warn_above": 0.0, "warn_below": 100.0, "warn_window": 1},  # any KL is "below"
                      logging={"tensorboard": True, "progress": False, "plots": False})
    GRPOTrainer(cfg, log=quiet).train()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("KL warning")]
    assert len(lines) == 1 and lines[0].startswith("KL warning at step 2:")  # window 1 skipped; 3 stays in
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("warnings/kl/text_summary")
    assert [t.step for t in texts] == [2]
    assert texts[0].tensor_proto.string_val[0].decode() == lines[0]


def test_the_demos_drift_threshold_lies_between_its_default_runs_and_its_runs_without_a_penalty():
    """The committed sweep tables: every default demo run ends below kl.warn_above (the warning stays quiet),
    every kl.coef 0 run ends above it (the warning speaks)."""
    import json
    from pathlib import Path

    from klgrpo.apps.demo_run import DEMO_WARN_ABOVE

    results = Path(__file__).resolve().parents[1] / "docs" / "results"

    def final_kls(table: str, setting: str) -> list[float]:
        cells = json.loads((results / table / "table.json").read_text())["cells"]
        return [r["values"]["final_kl"] for c in cells if c["setting"] == setting for r in c["runs"]]

    default, unpenalised = final_kls("demo_seeds", "kl.replay.coef=1"), final_kls("ablation", "kl.coef=0")
    assert len(default) == 3 and len(unpenalised) == 2
    assert max(default) < DEMO_WARN_ABOVE < min(unpenalised)


def test_entropy_collapse_band_is_announced_once_per_entry():
    from klgrpo.run.kl_watch import EntropyWatch

    watch = EntropyWatch(warn_below=0.5, window=2)
    out = {}
    for step, h in enumerate([1.0, 0.8, 0.4, 0.3, 0.2, 0.1, 0.9, 0.9, 0.3, 0.3], start=1):
        lines = watch.observe(step, h)
        if lines:
            out[step] = lines
    # windows: 0.9, 0.35 (enters), 0.15 (stays in), 0.9 (leaves), 0.3 (enters again)
    assert sorted(out) == [4, 10]
    assert out[4][0].startswith("entropy warning at step 4: the entropy is 0.35 nats per token (mean of steps 3-4)")
    assert "train.entropy_warn_below 0.5" in out[4][0] and "loss.entropy_coef" in out[4][0]
    assert EntropyWatch(0.0, 1).observe(1, 0.0) == []  # 0: off
    resumed = EntropyWatch(0.5, 2)
    resumed.load_state_dict(watch.state_dict())
    assert resumed.state_dict() == watch.state_dict()


def test_the_entropy_sign_reaches_the_console_and_tensorboard(tiny_model_dir, addition_file, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(tiny_model_dir, addition_file, tmp_path / "run", train={"steps": 2, "entropy_warn_below": 100.0,
                                                                              "entropy_warn_window": 1},
                      logging={"tensorboard": True, "progress": False, "plots": False})  # any entropy is "below"
    GRPOTrainer(cfg, log=quiet).train()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("entropy warning")]
    assert len(lines) == 1 and lines[0].startswith("entropy warning at step 1:")  # step 2 stays in the band
    events = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("warnings/entropy/text_summary")
    assert [t.step for t in texts] == [1] and texts[0].tensor_proto.string_val[0].decode() == lines[0]

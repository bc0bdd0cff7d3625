"""MetricsLogger sinks (metrics.jsonl, TensorBoard, progress bar), resume semantics, NaN policy, read_metrics."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from klgrpo.run.metrics import (
    GLOSSARY,
    MetricsFileError,
    MetricsLogger,
    describe,
    read_metrics,
    undocumented,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def steps_1_to_5() -> list[dict[str, float]]:
    return [{"train/reward": 0.1 * s, "adaptive_kl/raw_kl": 0.01 * s, "completions/mean_length": 3.0 + s}
            for s in range(1, 6)]


def strict_rows(path: Path) -> list[dict]:
    """Rows parsed by a strict JSON reader (bare NaN/Infinity would raise)."""
    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def without_wall_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_rows_are_exactly_the_logged_dicts(tmp_path):
    with MetricsLogger(tmp_path, 3, tensorboard=False, progress=False) as log:
        log.log(1, {"train/reward": 0.25, "kl/k3": 1e-7, "grad_norm": 3})
        # A 0-d tensor and a bool are accepted as numbers; a second call at the same step adds a row.
        log.log(2, {"train/reward": torch.tensor(0.5, dtype=torch.float64), "lr": 3e-4})
        log.log(2, {"eval/add": True})
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert without_wall_time(rows) == [
        {"step": 1, "train/reward": 0.25, "kl/k3": 1e-7, "grad_norm": 3.0},
        {"step": 2, "train/reward": 0.5, "lr": 3e-4},
        {"step": 2, "eval/add": 1.0},
    ]
    assert list(rows[0]) == ["step", "wall_time", "train/reward", "kl/k3", "grad_norm"]
    times = [r["wall_time"] for r in rows]
    assert all(t >= 0 for t in times) and times == sorted(times)
    assert read_metrics(tmp_path) == rows


def test_rows_are_flushed_before_close(tmp_path):
    log = MetricsLogger(tmp_path, 2, tensorboard=False, progress=False)
    log.log(1, {"train/reward": 1.0})
    # Another reader sees the complete line while the run is still going (a crash here keeps it).
    assert without_wall_time(read_metrics(tmp_path)) == [{"step": 1, "train/reward": 1.0}]
    log.close()
    log.close()  # idempotent
    with pytest.raises(RuntimeError):
        log.log(2, {"train/reward": 1.0})


def test_bad_calls_raise_clear_errors(tmp_path):
    with MetricsLogger(tmp_path, 3, tensorboard=False, progress=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 1.0})
        with pytest.raises(TypeError, match="'train/reward' must be a number"):
            log.log(1, {"train/reward": "high"})
        log.log(2, {"train/reward": 1.0})
        with pytest.raises(ValueError, match="backwards: 1 after 2"):
            log.log(1, {"train/reward": 1.0})


def test_resume_drops_rows_after_the_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with MetricsLogger(straight, 5, progress=False) as log:
        for step, m in enumerate(steps_1_to_5(), start=1):
            log.log(step, m)
    # First session: steps 1..5, but 4 and 5 with values the resumed run must replace (they were logged
    # after the checkpoint at step 3 and are lost with the crash).
    with MetricsLogger(resumed, 5, progress=False) as log:
        for step, m in enumerate(steps_1_to_5(), start=1):
            log.log(step, m if step <= 3 else {k: -1.0 for k in m})
    first_session = read_metrics(resumed)
    with MetricsLogger(resumed, 5, progress=False, start_step=3) as log:
        assert without_wall_time(read_metrics(resumed)) == without_wall_time(first_session[:3])
        for step, m in enumerate(steps_1_to_5(), start=1):
            if step > 3:
                log.log(step, m)

    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert without_wall_time(rows) == without_wall_time(read_metrics(straight))
    # wall_time continues from the kept rows instead of restarting at 0.
    assert rows[3]["wall_time"] >= rows[2]["wall_time"] == first_session[2]["wall_time"]
    assert not (resumed / "metrics.jsonl.tmp").exists()

    # TensorBoard: the first session's steps 4 and 5 are purged, each tag has steps 1..5 once.
    tb_straight, tb_resumed = scalars(straight / "tb"), scalars(resumed / "tb")
    assert set(tb_resumed) == set(tb_straight) == set(steps_1_to_5()[0])
    for tag in tb_straight:
        assert [s for s, _ in tb_resumed[tag]] == [1, 2, 3, 4, 5]
        assert tb_resumed[tag] == tb_straight[tag]  # same float32 values, steps 1..5


def test_resume_after_a_crash_mid_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "wall_time": 0.5, "train/reward": 1.0}\n'
                    '{"step": 2, "wall_time": 0.9, "train/reward": 2.0}\n'
                    '{"step": 3, "wall_time": 1.4, "train/re')
    with MetricsLogger(tmp_path, 5, tensorboard=False, progress=False, start_step=2) as log:
        log.log(3, {"train/reward": 3.0})
    rows = strict_rows(path)
    assert without_wall_time(rows) == [{"step": s, "train/reward": float(s)} for s in (1, 2, 3)]
    assert rows[2]["wall_time"] >= 0.9


def test_fresh_run_in_a_used_folder_starts_empty(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0.1, "old": 1}\nnot json\n')
    with MetricsLogger(tmp_path, 1, tensorboard=False, progress=False) as log:
        log.log(1, {"new": 2.0})
    assert without_wall_time(read_metrics(tmp_path)) == [{"step": 1, "new": 2.0}]


def test_non_finite_values_are_kept_visible(tmp_path, capsys):
    with MetricsLogger(tmp_path, 3, progress=False) as log:
        log.log(1, {"train/loss": math.nan, "grad_norm": math.inf, "kl/k1": -math.inf, "lr": 1e-3})
        log.log(2, {"train/loss": math.nan, "grad_norm": 2.0, "kl/k1": 0.0, "lr": 1e-3})
    out = capsys.readouterr().out
    # One warning per name at its first non-finite value, naming the step; none for step 2's repeat.
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3
    assert "step 1: train/loss is nan" in warnings[0]
    assert "step 1: grad_norm is inf" in warnings[1]
    assert "step 1: kl/k1 is -inf" in warnings[2]

    raw = strict_rows(tmp_path / "metrics.jsonl")  # still strict JSON
    assert raw[0]["train/loss"] == "NaN" and raw[0]["grad_norm"] == "Infinity" and raw[0]["kl/k1"] == "-Infinity"
    assert float(raw[0]["grad_norm"]) == math.inf  # the strings float() back

    rows = read_metrics(tmp_path)
    assert math.isnan(rows[0]["train/loss"]) and math.isnan(rows[1]["train/loss"])
    assert rows[0]["grad_norm"] == math.inf and rows[0]["kl/k1"] == -math.inf and rows[1]["grad_norm"] == 2.0

    tb = scalars(tmp_path / "tb")
    assert math.isnan(tb["train/loss"][0][1]) and tb["grad_norm"][0][1] == math.inf


def test_progress_bar_summary_line_and_silence_when_off(tmp_path, capsys):
    metrics = {"train/reward": 0.5, "adaptive_kl/raw_kl": 0.012345, "adaptive_kl/current_beta": 0.04,
               "completions/mean_length": 3.25, "time/step": 0.0812, "grad_norm": 1.0}
    with MetricsLogger(tmp_path / "quiet", 2, tensorboard=False, progress=False) as log:
        log.log(1, metrics)
        log.log(2, {"eval/add": 0.5})  # a row without the summary keys keeps the latest values
        assert log.summary() == "reward 0.5 | kl 0.0123 | beta 0.04 | len 3.25 | s/step 0.0812"
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""

    with MetricsLogger(tmp_path / "bar", 2, tensorboard=False, progress=True,
                       summary_keys=("train/reward", "grad_norm")) as log:
        log.log(1, metrics)
        assert log.summary() == "reward 0.5 | grad_norm 1"
        log.message("hello from the trainer")
    captured = capsys.readouterr()
    assert "hello from the trainer" in captured.out
    assert "reward 0.5 | grad_norm 1" in captured.err  # the bar's postfix


def test_read_metrics_skips_a_truncated_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0.1, "a": 1}\n{"step": 2, "wall_ti')
    assert read_metrics(tmp_path) == [{"step": 1, "wall_time": 0.1, "a": 1}]
    # The file path itself is accepted too.
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "wall_time": 0.1, "a": 1}]


def test_read_metrics_names_file_and_line_of_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": \n{"step": 3, "a": 3}\n')
    with pytest.raises(MetricsFileError, match=re.escape(f"{path}, line 2: not valid JSON")):
        read_metrics(tmp_path)
    # A complete (newline-terminated) last line that does not parse is corruption, not truncation.
    path.write_text('{"step": 1, "a": 1}\n[1, 2]\n')
    with pytest.raises(MetricsFileError, match="line 2: expected a JSON object"):
        read_metrics(tmp_path)


def test_read_metrics_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)


def test_describe_matches_names_and_patterns():
    assert describe("kl/k3") == GLOSSARY["kl/k3"]
    assert describe("rewards/exact_answer") == GLOSSARY["rewards/<function>"]
    assert describe("eval/subtraction_retention") == GLOSSARY["eval/<name>"]
    assert describe("eval/subtraction_retention/entropy") == GLOSSARY["eval/<name>/entropy"]
    assert describe("eval/") is None
    assert undocumented(["train/loss", "eval/add", "kl/k4", "loss"]) == ["kl/k4", "loss"]


def test_glossary_covers_the_names_users_know():
    known = ["train/kl_penalty", "train/loss", "train/reward", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl",
             "adaptive_kl/current_beta", "kl/k1", "kl/k2", "kl/k3", "kl/max", "kl/clamp_frac",
             "completions/mean_length", "completions/clipped_ratio", "clip_ratio", "entropy", "grad_norm",
             "time/generate", "time/reference", "time/update", "time/step"]
    assert undocumented(known) == []
    assert all(text and "\n" not in text for text in GLOSSARY.values())


def test_every_glossary_name_is_in_the_docs():
    text = DOCS.read_text()
    missing = [name for name in GLOSSARY if f"`{name}`" not in text]
    assert missing == [], f"add these names to {DOCS}: {missing}"


def test_masked_quantiles_equal_torch_quantile_of_the_masked_values():
    import torch

    from klgrpo.train.step_metrics import PERCENTILES, masked_quantiles

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 6, 9, generator=gen, dtype=torch.float64).float()
    mask = torch.rand(6, 9, generator=gen) < 0.6
    got = masked_quantiles(values, mask, PERCENTILES)
    for k in range(2):
        expected = torch.quantile(values[k][mask], torch.tensor(PERCENTILES))
        torch.testing.assert_close(got[k], expected, rtol=1e-6, atol=1e-7)
    # by hand: the masked values 1, 2, 3, 10 -> p50 = 2.5, p90 = 3 + 0.7 * 7 = 7.9, p99 = 3 + 0.97 * 7 = 9.79
    row = torch.tensor([[[3.0, 100.0, 1.0, 10.0, 2.0]]])
    hand = masked_quantiles(row, torch.tensor([[True, False, True, True, True]]), PERCENTILES)[0]
    torch.testing.assert_close(hand, torch.tensor([2.5, 7.9, 9.79]))
    assert masked_quantiles(row, torch.zeros(1, 5, dtype=torch.bool), PERCENTILES).isnan().all()


def test_loss_share_is_the_magnitude_share():
    from klgrpo.train.step_metrics import loss_share

    assert loss_share(0.25, 0.75) == 0.25 and loss_share(0.0, 0.0) == 0.0 and loss_share(-1.0, 0.0) == 1.0

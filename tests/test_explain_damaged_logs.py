"""``klgrpo explain --run`` on logs that are damaged: TensorBoard event files cut short, with flipped bytes or bytes
appended, said with where the log ends and the last step read (text and JSON); NaN and infinite KL steps named,
never dropped unsaid (TensorBoard, klgrpo's metrics.jsonl, TRL's trainer_state.json); log files that are FIFOs or
devices refused from their stat, never opened."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

from klgrpo.apps.explain import main

KL, COEF = "actor/kl_loss", "actor/kl_coef"


def _verl_events(folder: Path, kl_values) -> tuple[Path, list[int]]:
    """One event file as verl's tensorboard tracker writes it (SummaryWriter.add_scalar per key, steps from 1),
    and the file's size once each step was flushed: sizes[k] is where step k's records end."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    writer.flush()
    sizes = [_only_file(folder).stat().st_size]  # the file_version record
    for step, value in enumerate(kl_values, 1):
        writer.add_scalar(KL, value, step)
        writer.add_scalar(COEF, 0.001, step)
        writer.flush()
        sizes.append(_only_file(folder).stat().st_size)
    writer.close()
    return _only_file(folder), sizes


def _only_file(folder: Path) -> Path:
    (file,) = folder.iterdir()
    return file


def _summary(tmp_path, folder) -> dict:
    out = tmp_path / "run.json"
    assert main(["--run", str(folder), "--json", str(out)]) == 0
    return json.loads(out.read_text())


KL_VALUES = [0.125 * step for step in range(1, 11)]  # float32-exact


def test_a_whole_event_file_has_no_damage_and_reads_as_tensorboards_own_loader_reads_it(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    _verl_events(tmp_path / "tb", KL_VALUES)
    summary = _summary(tmp_path, tmp_path / "tb")
    assert summary["damaged"] == [] and summary["non_finite"] == []
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    theirs = [(e.step, e.value) for e in accumulator.Scalars(KL)]
    assert theirs == list(enumerate(KL_VALUES, 1))
    assert summary["kl"]["points"] == 10 and summary["kl"]["last"] == {"step": 10, "value": 1.25}
    assert summary["beta"]["first"]["value"] == accumulator.Scalars(COEF)[0].value  # float32 0.001, as stored


@pytest.mark.parametrize("kept_steps, into_next", [(6, 5), (6, 13), (9, 1), (0, 3)])
def test_an_event_file_cut_short_says_where_it_ends(tmp_path, capsys, kept_steps, into_next):
    # cut `into_next` bytes into the records after step `kept_steps` (a 12-byte record header, then its data)
    file, sizes = _verl_events(tmp_path / "tb", KL_VALUES)
    cut = sizes[kept_steps] + into_next
    os.truncate(file, cut)
    summary = _summary(tmp_path, tmp_path / "tb") if kept_steps else None
    if summary is None:  # nothing but the file's version record: no KL at all, one line naming the damage
        assert main(["--run", str(tmp_path / "tb")]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and "logs none of the metric names" in err and f"at byte {sizes[0]} of {cut}" in err
        ), err
        assert "no step read before it" in err
        return
    assert summary["damaged"] == [
        {
            "file": str(file),
            "what": "cut_short",
            "at_byte": sizes[kept_steps],
            "file_bytes": cut,
            "last_step": kept_steps,
        }
    ]
    assert summary["kl"]["last"] == {"step": kept_steps, "value": KL_VALUES[kept_steps - 1]}
    assert summary["kl"]["points"] == kept_steps
    printed = capsys.readouterr().out
    assert (
        f"damaged: {file} is cut short (its last record is incomplete) at byte {sizes[kept_steps]} of {cut}: "
        f"read to step {kept_steps}, the rest ({into_next} bytes) not read"
    ) in printed


@pytest.mark.parametrize("where", ["length", "length_crc", "data", "data_crc"])
def test_a_flipped_byte_stops_the_read_at_its_record(tmp_path, capsys, where):
    file, sizes = _verl_events(tmp_path / "tb", KL_VALUES)
    start, end = sizes[4], sizes[5]  # step 5's records; its first is actor/kl_loss: 12 + data + 4 bytes
    at = {"length": start + 1, "length_crc": start + 9, "data": start + 20, "data_crc": None}[where]
    data = bytearray(file.read_bytes())
    if at is None:  # the last byte of step 5's first record: its data CRC
        length = int.from_bytes(data[start : start + 8], "little")
        at = start + 12 + length + 3
    assert start <= at < end
    data[at] ^= 0x40
    file.write_bytes(bytes(data))
    summary = _summary(tmp_path, tmp_path / "tb")
    assert summary["damaged"] == [
        {"file": str(file), "what": "bad_checksum", "at_byte": start, "file_bytes": len(data), "last_step": 4}
    ]
    assert summary["kl"]["last"] == {"step": 4, "value": 0.5} and summary["kl"]["points"] == 4
    assert "holds bytes that fail their record's checksum at byte" in capsys.readouterr().out


@pytest.mark.parametrize(
    "tail, what",
    [
        (b"garbage appended after the last record", "bad_checksum"),
        (b"\x00" * 5, "cut_short"),
        (b"\x00" * 16, "bad_checksum"),
    ],
)
def test_bytes_appended_are_said_and_not_read(tmp_path, tail, what):
    # 16 zero bytes: length 0 with a CRC of 0, which is not the masked CRC of eight zero bytes
    file, sizes = _verl_events(tmp_path / "tb", KL_VALUES)
    with open(file, "ab") as handle:
        handle.write(tail)
    summary = _summary(tmp_path, tmp_path / "tb")
    assert summary["damaged"] == [
        {"file": str(file), "what": what, "at_byte": sizes[-1], "file_bytes": sizes[-1] + len(tail), "last_step": 10}
    ]
    assert summary["kl"]["points"] == 10


def test_a_whole_record_that_is_no_event(tmp_path):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    file, sizes = _verl_events(tmp_path / "tb", KL_VALUES[:3])
    payload = b"\xff\xff\xff"  # a field header with no end: no protobuf parses it
    length = len(payload).to_bytes(8, "little")
    record = (
        length + masked_crc32c(length).to_bytes(4, "little") + payload + masked_crc32c(payload).to_bytes(4, "little")
    )
    with open(file, "ab") as handle:
        handle.write(record)
    summary = _summary(tmp_path, tmp_path / "tb")
    assert [(d["what"], d["at_byte"], d["last_step"]) for d in summary["damaged"]] == [("not_an_event", sizes[-1], 3)]


def test_a_damaged_older_file_and_a_whole_newer_one(tmp_path):
    # a run that crashed mid-write, then resumed from its step-4 checkpoint in a new event file
    from torch.utils.tensorboard import SummaryWriter

    old, sizes = _verl_events(tmp_path / "old", KL_VALUES[:6])
    os.truncate(old, sizes[4] + 7)
    (tmp_path / "tb").mkdir()
    old.rename(tmp_path / "tb" / "events.out.tfevents.1000.host.1.0")
    writer = SummaryWriter(str(tmp_path / "tb"), filename_suffix="")
    for step in range(5, 9):
        writer.add_scalar(KL, 0.0625 * step, step)
        writer.add_scalar(COEF, 0.001, step)
    writer.close()
    summary = _summary(tmp_path, tmp_path / "tb")
    assert [(Path(d["file"]).name, d["last_step"]) for d in summary["damaged"]] == [
        ("events.out.tfevents.1000.host.1.0", 4)
    ]
    assert summary["kl"]["points"] == 8 and summary["kl"]["last"] == {"step": 8, "value": 0.5}


def _nan_from_6(step):
    return math.nan if step >= 6 else 0.125 * step


def test_nan_kl_steps_are_named_in_tensorboard(tmp_path, capsys):
    _verl_events(tmp_path / "tb", [_nan_from_6(step) for step in range(1, 11)])
    summary = _summary(tmp_path, tmp_path / "tb")
    assert summary["non_finite"] == [
        {
            "what": "kl",
            "metric": KL,
            "values": ["NaN"],
            "first_step": 6,
            "steps": 5,
            "of_steps": 10,
            "step_ranges": ["6-10"],
        }
    ]
    assert summary["kl"]["points"] == 5 and summary["kl"]["last"] == {"step": 5, "value": 0.625}
    assert "not finite: actor/kl_loss is NaN from step 6, 5 of 10 logged steps (steps 6-10)" in capsys.readouterr().out


def test_inf_and_nan_at_scattered_steps(tmp_path):
    values = [0.125, math.inf, 0.25, 0.25, -math.inf, math.nan, 0.5, 0.5]
    _verl_events(tmp_path / "tb", values)
    (entry,) = _summary(tmp_path, tmp_path / "tb")["non_finite"]
    assert entry["values"] == ["-inf", "NaN", "inf"] and entry["step_ranges"] == ["2", "5-6"]
    assert (entry["first_step"], entry["steps"], entry["of_steps"]) == (2, 3, 8)


def test_a_kl_that_is_never_finite_is_one_line(tmp_path, capsys):
    _verl_events(tmp_path / "tb", [math.nan] * 4)
    assert main(["--run", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "actor/kl_loss is NaN from step 1, 4 of 4 logged steps" in err, err


def test_nan_in_a_klgrpo_metrics_jsonl_is_named(tmp_path, capsys):
    # klgrpo's MetricsLogger writes non-finite values as the strings "NaN" / "Infinity"
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {
            "step": step,
            "adaptive_kl/raw_kl": "NaN" if step in (3, 4) else 0.01 * step,
            "adaptive_kl/current_beta": "Infinity" if step == 5 else 0.1,
        }
        for step in range(1, 7)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = _summary(tmp_path, run)
    assert [(e["what"], e["values"], e["step_ranges"], e["of_steps"]) for e in summary["non_finite"]] == [
        ("kl", ["NaN"], ["3-4"], 6),
        ("beta", ["inf"], ["5"], 6),
    ]
    assert summary["kl"]["points"] == 4 and summary["beta"]["changes"] == 0
    printed = capsys.readouterr().out
    assert "adaptive_kl/raw_kl is NaN from step 3, 2 of 6 logged steps (steps 3-4)" in printed
    assert "adaptive_kl/current_beta is inf from step 5, 1 of 6 logged steps (steps 5)" in printed


def test_a_klgrpo_metrics_jsonl_cut_mid_line_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    whole = "".join(json.dumps({"step": step, "adaptive_kl/raw_kl": 0.01}) + "\n" for step in range(1, 4))
    (run / "metrics.jsonl").write_text(whole + '{"step": 4, "adaptive_kl/ra')
    summary = _summary(tmp_path, run)
    assert summary["damaged"] == [
        {
            "file": str(run / "metrics.jsonl"),
            "what": "cut_short",
            "at_byte": len(whole),
            "file_bytes": len(whole) + 27,
            "last_step": 3,
        }
    ]


def test_nan_in_a_trl_trainer_state_is_named(tmp_path):
    # TRL's Trainer writes trainer_state.json with json.dumps, which spells NaN as the literal NaN
    history = [{"step": step, "kl": math.nan if step == 2 else 0.5, "reward": 0.25} for step in range(1, 5)]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert "NaN" in (tmp_path / "out" / "trainer_state.json").read_text()
    (entry,) = _summary(tmp_path, tmp_path / "out")["non_finite"]
    assert (entry["metric"], entry["step_ranges"], entry["steps"], entry["of_steps"]) == ("kl", ["2"], 1, 4)


class _Hung(Exception):
    pass


@pytest.fixture
def no_hang():
    """A FIFO opened for reading would wait for a writer for ever: fail the test after 10 s instead."""

    def hung(*_):
        raise _Hung("explain opened a FIFO and waited")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "name",
    [
        "tb/events.out.tfevents.1.host",
        "metrics.jsonl",
        "trainer_state.json",
        "checkpoint-4/trainer_state.json",
        "wandb/offline-run-20260101_000000-abc/run-abc.wandb",
    ],
)
def test_a_fifo_log_is_refused_unopened(tmp_path, capsys, no_hang, name):
    fifo = tmp_path / "run" / name
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert main(["--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{fifo} is a FIFO (named pipe), not a regular file" in err, err


def test_a_device_as_an_event_file_is_refused(tmp_path, capsys, no_hang):
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1.host").symlink_to("/dev/zero")
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a device, not a regular file" in err, err


def test_a_fifo_wandb_summary_is_not_read(tmp_path, capsys, monkeypatch, no_hang):
    # without wandb the run is refused with a hint from files/wandb-summary.json: a FIFO there gives no hint
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    run = tmp_path / "wandb" / "offline-run-20260101_000000-abc"
    (run / "files").mkdir(parents=True)
    (run / "run-abc.wandb").write_bytes(b"not read")
    os.mkfifo(run / "files" / "wandb-summary.json")
    assert main(["--run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the wandb package" in err and "holds only the last" not in err, err

"""Numbers the README and docs quote come from committed results files written by the commands that produced
them: each quoted figure is read back from its file here (a rerun that changes a file must change the docs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_demo_gain_is_the_seed_sweeps():
    table = json.loads((ROOT / "docs" / "results" / "demo_seeds" / "table.json").read_text())
    (cell,) = table["cells"]
    stats = cell["stats"]["addition/change"]
    seed0 = next(r for r in cell["runs"] if r["seed"] == 0)["values"]["addition/change"]
    readme = " ".join(ROOT.joinpath("README.md").read_text().split())
    quoted = (f"the trained skill gains {stats['mean']:+.1f} ± {stats['std']:.1f} points over seeds "
              f"{min(cell['seeds'])}-{max(cell['seeds'])}, from {stats['min']:+.1f} to {stats['max']:+.1f}, and "
              f"seed 0, what `klgrpo train` runs, gains {seed0:+.1f}")
    assert quoted in readme
    assert "klgrpo sweep --grid kl.replay.coef=1 --seeds 0,1,2" in (ROOT / "docs/results/demo_seeds/table.md").read_text()


def test_custom_loss_cost_table_is_the_results_file():
    results = (ROOT / "benchmarks" / "results" / "custom_loss_cost_cpu.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (tiny|small) +\| ([^|]+?) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\|$",
                      results, flags=re.M)
    assert len(rows) == 10
    for shape, loss, *numbers in rows:
        label = loss.replace("ppo_kl", "`ppo_kl`").replace("2 passes", "2 passes (hosted route)")
        assert f"| {shape} | {label} | {' | '.join(numbers)} |" in docs, (shape, loss)


def test_trl_method_tables_are_the_results_files():
    """docs/trl.md's two seed tables, row by row, against docs/results/trl_adaptive_kl_seed{0,1}.md (the output of
    examples/trl_adaptive_kl.py --seed S)."""
    labels = {"baseline": "baseline", "clip": "clip (0.05)", "length_normalized": "length_normalized",
              "dynamic": "dynamic (threshold 0.1)", "sigmoid": "sigmoid (target 0.05)",
              "baseline_beta/10": "baseline_beta/10 (control)"}
    docs = (ROOT / "docs" / "trl.md").read_text()
    for seed in (0, 1):
        results = (ROOT / "docs" / "results" / f"trl_adaptive_kl_seed{seed}.md").read_text()
        assert f"python examples/trl_adaptive_kl.py --seed {seed}" in results
        rows = re.findall(r"^\| (\S+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| +([\d.]+) -> +([\d.]+) +\|",
                          results, flags=re.M)
        assert len(rows) == 6
        section = docs[docs.index(f"Seed {seed}:"):]
        for name, raw, adapted, beta, reward, start, late in rows:
            row = f"| {labels[name]} | {raw} | {adapted} | {beta} | {reward} | {start} -> {late} |"
            assert row in section[:section.index("\n\n", section.index("|---"))], row


def test_kl_guide_demo_table_is_the_kl_commands_json():
    import json

    guide = (ROOT / "docs" / "kl_guide.md").read_text()
    for skill in ("addition", "subtraction"):
        report = json.loads((ROOT / "docs" / "results" / f"demo_kl_sft_vs_trained_{skill}.json").read_text())
        assert report["command"].startswith("klgrpo kl ")
        for name in ("full", "k1", "k2", "k3"):
            t, q = report["per_token"][name], report["per_sequence"][name]
            row = (f"| {skill} | {name} | {t['mean']:.4f} | {t['p99']:.3g} | {t['max']:.3g} | "
                   f"{q['mean']:.3f} ± {q['sem']:.3f} |")
            assert row in guide, row


def _entropy_cost_rows(shape: str, log: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(time off, time on, memory off, memory on) table cells of one shape in the entropy-cost results file."""
    section = log[log.index(f"{shape}: ms per optimizer step"):]
    rows = re.findall(r"^\| (?:baseline train\.entropy_metrics=false|current) +\|([^\n]+)\|$", section, flags=re.M)
    return tuple([cell.strip() for cell in row.split("|")] for row in rows[:4])


def test_entropy_metrics_cost_is_the_results_file():
    log = (ROOT / "benchmarks" / "results" / "entropy_metrics_cost_cpu.log").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "speedup.py --baseline-config train.entropy_metrics=false --memory" in log
    ratios = {}
    for shape in ("tiny", "small"):
        time_off, time_on, memory_off, memory_on = _entropy_cost_rows(shape, log)
        row = (f"| {shape} | {time_off[4]} | {time_on[4]} | **{time_on[6]}** | {memory_off[0]} | {memory_on[0]} | "
               f"**{memory_on[2]}** |")
        assert row in docs, row
        ratios[shape] = (time_on[6], memory_on[2])
        assert float(time_on[6]) <= 1.05 and float(memory_on[2]) <= 1.05  # the goal the docs say is met
    summary = (f"time {ratios['tiny'][0]}x (tiny), {ratios['small'][0]}x (small); memory {ratios['tiny'][1]}x, "
               f"{ratios['small'][1]}x; ")
    assert summary in docs
    vocab_log = (ROOT / "benchmarks" / "results" / "entropy_metrics_cost_cpu_qwen_vocab.log").read_text()
    time_off, time_on, memory_off, memory_on = _entropy_cost_rows("tiny_qwen_vocab", vocab_log)
    assert (f"| tiny_qwen_vocab | {time_off[4]} | {time_on[4]} | **{time_on[6]}** | {memory_off[0]} | "
            f"{memory_on[0]} | **{memory_on[2]}** |") in docs
    assert f"grows from {time_off[2]} to {time_on[2]} ms" in docs and f"medians is {time_on[5]})" in docs
    assert f"output layer: time {time_on[6]}x, memory {memory_on[2]}x |" in docs

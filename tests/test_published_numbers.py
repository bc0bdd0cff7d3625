"""Numbers the README and docs quote come from committed results files written by the commands that produced
them: each quoted figure is read back from its file here (a rerun that changes a file must change the docs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"  # the README's front door links here for the demo and the numbers


def test_quickstart_demo_gain_is_the_seed_sweeps():
    table = json.loads((ROOT / "docs" / "results" / "demo_seeds" / "table.json").read_text())
    (cell,) = table["cells"]
    stats = cell["stats"]["addition/change"]
    seed0 = next(r for r in cell["runs"] if r["seed"] == 0)["values"]["addition/change"]
    quickstart = " ".join(QUICKSTART.read_text().split())
    quoted = (f"the trained skill gains {stats['mean']:+.1f} ± {stats['std']:.1f} points over seeds "
              f"{min(cell['seeds'])}-{max(cell['seeds'])}, from {stats['min']:+.1f} to {stats['max']:+.1f} "
              f"([results/demo_seeds/table.md]")
    assert quoted in quickstart
    assert stats["min"] <= seed0 <= stats["max"]
    table = (ROOT / "docs/results/demo_seeds/table.md").read_text()
    assert "klgrpo sweep --grid kl.replay.coef=1 --seeds 0,1,2" in table


def test_custom_loss_cost_table_is_the_results_file():
    results = (ROOT / "benchmarks" / "results" / "custom_loss_cost_cpu.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (tiny|small) +\| ([^|]+?) +"
                      r"\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\|$",
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
        rows = re.findall(r"^\| (\S+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+) "
                          r"+\| +([\d.]+) -> +([\d.]+) +\|",
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


# ----------------------------------------------------------------------------- tables read cell by cell
def _cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def _doc_row(text: str, first: str) -> list[str]:
    """The cells of the one table row of ``text`` whose first cell is ``first``."""
    rows = [_cells(line) for line in text.splitlines() if line.startswith("|") and _cells(line)[0] == first]
    assert len(rows) == 1, (first, len(rows))
    return rows[0]


def _log_row(log: str, *first: str) -> list[str]:
    """The cells of the table row of a results log whose first cells are ``first``."""
    rows = [_cells(line) for line in log.splitlines() if line.startswith("|")]
    found = [r for r in rows if tuple(r[:len(first)]) == first]
    assert len(found) == 1, (first, len(found))
    return found[0]


def test_gpu_vs_trl_table_is_the_results_json():
    results = json.loads((ROOT / "benchmarks/results/gpu_vs_trl_h200.json").read_text())
    docs = (ROOT / "docs/benchmarks.md").read_text()
    labels = {"TRL static cache": 'TRL 1.16, `cache_implementation="static"`',
              "klgrpo default": "klgrpo default, first process on the machine",
              "klgrpo default, 2nd process": "klgrpo default, second process (compile caches warm)"}
    rows = {r["variant"]: r for r in results["rows"]}
    assert set(rows) == set(labels) and results["steps"] == 12
    trl = rows["TRL static cache"]["mean"]
    for variant, r in rows.items():
        ratio = r["mean"] / trl
        expected = [labels[variant], f"{r['mean']:.3f}", "1" if variant.startswith("TRL") else f"{ratio:.2f}",
                    f"{r['median']:.3f}", f"{r['max']:.3f}", f"{r['max_over_median']:.2f}", f"{r['first']:.1f} s",
                    f"{r['generate_mean']:.3f}", f"{r['reference_mean']:.3f}", f"{r['update_mean']:.3f}",
                    f"{r['peak_gb']:.1f}"]
        assert _doc_row(docs, labels[variant]) == expected


def test_gpu_vs_trl_first_call_figures_are_the_log():
    log = (ROOT / "benchmarks/results/gpu_vs_trl_h200_first_call.log").read_text()
    docs = " ".join((ROOT / "docs/benchmarks.md").read_text().split())
    mean = dict(re.findall(r"^(.+?): \d+ s in all; mean ([\d.]+) s/step", log, flags=re.M))
    assert (f"klgrpo default {mean['klgrpo default']} s/step (first process), {mean['klgrpo default, 2nd process']} "
            f"(second); TRL default {mean['TRL default']}, TRL static {mean['TRL static cache']}") in docs


def test_sampler_table_is_the_results_json():
    samplers = json.loads((ROOT / "benchmarks/results/gpu_samplers_h200.json").read_text())["rollout_samplers_bf16"]
    docs = (ROOT / "docs/benchmarks.md").read_text()
    loop = samplers["klgrpo_loop"]["s_per_batch"]
    for key, label, first_suffix in (("klgrpo_loop", "klgrpo's KV-cached loop", ""),
                                     ("generate_dynamic", "transformers `generate`, dynamic cache", ""),
                                     ("generate_static", "transformers `generate`, static cache", " (compiles)")):
        s = samplers[key]
        row = _doc_row(docs, label)
        assert row[2:] == [f"{s['first_call_s']:.1f}{first_suffix}", f"{s['s_per_batch']:.3f}",
                           f"{s['s_per_batch'] / loop:.2f}"], key


def test_static_cache_table_is_the_results_log():
    log = (ROOT / "benchmarks/results/vs_trl_static_cache_h200.log").read_text()
    docs = (ROOT / "docs/benchmarks.md").read_text()
    labels = {"klgrpo": "klgrpo (default)",
              "klgrpo, generate_cache static": "klgrpo, `rollout.generate_cache: static` (now `rollout.sampler: "
                                               "generate_static`, the default on CUDA)"}
    for variant, label in labels.items():
        ratio = [r for r in (_cells(line) for line in log.splitlines() if line.startswith("| qwen0.5b"))
                 if r[1] == variant and len(r) == 9][0]
        phase_rows = [_cells(line) for line in log.splitlines() if line.startswith("| qwen0.5b")]
        phases = [r for r in phase_rows if r[1] == variant and len(r) == 7][0]
        expected = [label, ratio[3], f"{float(ratio[5]):.2f}", *(f"{float(v):.0f}" for v in phases[2:5])]
        assert _doc_row(docs, label) == expected, variant
    rows = [_cells(line) for line in log.splitlines() if line.startswith("| qwen0.5b")]
    trl = [r for r in rows if r[1] == "TRL" and len(r) == 7][0]
    trl_step = [r for r in rows if r[1] == "klgrpo" and len(r) == 9][0][2]
    assert _doc_row(docs, "TRL 1.16") == ["TRL 1.16", trl_step, "1", *(f"{float(v):.0f}" for v in trl[2:5])]


def test_ablation_tables_are_the_sweeps_table():
    """docs/ablation.md's measured table is the sweep's table.md, row by row; its per-seed table is table.json."""
    results = (ROOT / "docs/results/ablation/table.md").read_text()
    docs = _section((ROOT / "docs/ablation.md").read_text(), "## The first measurement")
    rows = [line for line in results.splitlines() if line.startswith("| kl.")]
    assert len(rows) == 6
    for line in rows:
        assert _doc_row(docs, _cells(line)[0]) == _cells(line)
    before = results[results.index("Before training"):].split("\n")[0]
    assert before in docs
    table = json.loads((ROOT / "docs/results/ablation/table.json").read_text())
    runs = {(c["setting"], r["seed"]): r["values"] for c in table["cells"] for r in c["runs"]}
    for beta in ("0", "0.01", "0.1"):
        for seed in (0, 1):
            v = runs[(f"kl.coef={beta}", seed)]
            row = [c for c in (_cells(line) for line in docs.splitlines() if line.startswith("|"))
                   if c[:2] == [beta, str(seed)]]
            assert row == [[beta, str(seed), f"{100 * v['add/after']:.1f}%", f"{100 * v['capitals/after']:.1f}%",
                            f"{100 * v['opposites/after']:.1f}%", f"{v['final_kl']:.2f}"]], (beta, seed)


def test_kl_guide_full_kl_gpu_figures_are_the_log():
    log = (ROOT / "benchmarks/results/logprob_memory_h200.log").read_text()
    guide = " ".join((ROOT / "docs/kl_guide.md").read_text().split())
    full_f, full_b = _log_row(log, "logp+entropy+full KL", "forward"), _log_row(log, "logp+entropy+full KL",
                                                                              "forward+backward")
    plain_f, plain_b = _log_row(log, "klgrpo", "forward"), _log_row(log, "klgrpo", "forward+backward")
    assert (f"{full_f[2]} ms forward and {full_b[2]} ms forward+backward against {float(plain_f[2]):.1f} ms / "
            f"{float(plain_b[2]):.1f} ms for the log-probs alone (about {float(full_f[2]) / float(plain_f[2]):.0f}x), "
            f"extra peak {full_f[4]}x the logits forward and {full_b[5]}x forward+backward beyond the logits' "
            f"gradient") in guide


def test_trl_seed_times_are_the_results_files():
    docs = " ".join((ROOT / "docs/trl.md").read_text().split())
    seconds = []
    for seed in (0, 1):
        results = (ROOT / "docs/results" / f"trl_adaptive_kl_seed{seed}.md").read_text()
        seconds.append(sum(int(_cells(line)[6]) for line in results.splitlines()
                           if line.startswith("| ") and _cells(line)[6].isdigit()))
    assert (f"The six methods of a seed took {seconds[0]} s (seed 0) and {seconds[1]} s (seed 1) on a shared "
            f"2-core machine") in docs


def test_retention_demo_seeds_are_the_seed_sweeps():
    table = json.loads((ROOT / "docs" / "results" / "demo_seeds" / "table.json").read_text())
    (cell,) = table["cells"]
    runs = {r["seed"]: r["values"] for r in cell["runs"]}
    quoted = ", ".join(f"seed {s} {runs[s]['addition/change']:+.1f} / {runs[s]['subtraction/change']:+.1f}"
                       for s in sorted(runs))
    retention = " ".join((ROOT / "docs" / "retention.md").read_text().split())
    assert f"points of addition / subtraction ([results/demo_seeds/table.md](results/demo_seeds/table.md)): " \
           f"{quoted}." in retention


def test_readme_test_count_and_time_are_the_recorded_run():
    """The README and the quickstart's "Development" quote the recorded run's count and time."""
    record = (ROOT / "docs/results/test_suite.txt").read_text()
    passed, skipped, seconds = re.search(r"^(\d+) passed, (\d+) skipped, .* in ([\d.]+)s", record, flags=re.M).groups()
    assert int(skipped) == sum(int(n) for n in re.findall(r"^SKIPPED \[(\d+)\]", record, flags=re.M))
    for page, link in ((ROOT / "README.md", "docs/results/test_suite.txt"), (QUICKSTART, "results/test_suite.txt")):
        text = " ".join(page.read_text().split())
        assert (f"runs the default suite ({passed} passed and {skipped} skipped, in {float(seconds):.0f} s on 2 CPU "
                f"cores: [{link}]({link}))") in text, page.name


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


def test_readme_first_run_times_are_the_recorded_fresh_clone_run():
    """The demo times (set-up included, SFT, GRPO) that the README and the quickstart quote are those of
    docs/results/first_run.txt, rounded, and so is the quickstart's seed-0 gain of that run."""
    record = (ROOT / "docs/results/first_run.txt").read_text()

    def seconds(label: str) -> float:
        minutes, secs = re.search(rf"^{label}: (\d+)m([\d.]+)s$", record, flags=re.M).groups()
        return 60 * int(minutes) + float(secs)

    total = seconds(re.escape("set-up (venv + pip install)")) + seconds("klgrpo train")
    sft = float(re.search(r"demo assets: ready in ([\d.]+) s", record).group(1))
    grpo = float(re.search(r"GRPO wall ([\d.]+) s", record).group(1))
    for page, link in ((ROOT / "README.md", "docs/results/first_run.txt"), (QUICKSTART, "results/first_run.txt")):
        text = " ".join(page.read_text().split())
        assert f"{total:.0f} s on 2 idle cores from a fresh clone, set-up included" in text, page.name
        assert f"{sft:.0f} s of SFT, {grpo:.0f} s of GRPO ([{link}]({link}))" in text, page.name
    gain = re.search(r"^  addition \(trained\) .* ([+-][\d.]+)$", record, flags=re.M).group(1)
    quickstart = " ".join(QUICKSTART.read_text().split())
    assert f"seed 0, what `klgrpo train` runs, gained {gain} in the recorded run above" in quickstart


def test_quickstart_demo_digits_per_cpu_are_the_recorded_runs():
    """The quickstart states the demo's result as the seeds' range and says that one run's digits depend on the CPU's
    vector instructions: the seed-0 gains it quotes for other instruction sets are those of
    docs/results/demo_cpu_capability.txt, where the same seed and code gave different digits per capability."""
    record = (ROOT / "docs/results/demo_cpu_capability.txt").read_text()
    runs = re.findall(r"^\$ (.*)klgrpo train\ntorch CPU capability: (\w+)\n(?:.*\n)*?  addition \(trained\) .* "
                      r"([+-][\d.]+)$", record, flags=re.M)
    gains = {capability: gain for _, capability, gain in runs}
    assert set(gains) == {"AVX2", "DEFAULT"} and len(set(gains.values())) == 2  # the digits change with the CPU
    assert "ATEN_CPU_CAPABILITY=default" in next(command for command, capability, _ in runs if capability == "DEFAULT")
    quickstart = " ".join(QUICKSTART.read_text().split())
    assert (f"{gains['AVX2']} on an AVX2-only CPU and {gains['DEFAULT']} there with the vectorized kernels off "
            f"(`ATEN_CPU_CAPABILITY=default`; [results/demo_cpu_capability.txt]") in quickstart
    assert "bit for bit" not in quickstart.split("## What the demo does")[0]
    assert "bit for bit" not in (ROOT / "README.md").read_text()



def _section(text: str, heading: str) -> str:
    """``text`` from ``heading`` to the next heading of the same level."""
    start = text.index(heading)
    level = heading.split(" ")[0] + " "
    end = text.find("\n" + level, start + len(heading))
    return text[start:] if end < 0 else text[start:end]


FORGETTING = ROOT / "docs/results/forgetting"


def test_forgetting_sweep_tables_are_the_sweeps_table():
    """docs/ablation.md's forgetting section quotes the sweep's table.md: every row of both tables and every
    paired sentence; every setting has five seeds; the sentences' numbers are table.json's."""
    results = (FORGETTING / "table.md").read_text()
    docs = _section((ROOT / "docs/ablation.md").read_text(), "## Where forgetting happens")
    rows = [line for line in results.splitlines() if line.startswith("| kl.")]
    assert len(rows) == 7 + 6  # the table's settings, then each but beta 0 against beta 0
    for line in rows:
        assert line in docs, line
    sentences = [line for line in results.splitlines() if line.startswith("- kl.")]
    assert len(sentences) == 6 and all(s in docs for s in sentences)
    table = json.loads((FORGETTING / "table.json").read_text())
    assert [c["seeds"] for c in table["cells"]] == [[0, 1, 2, 3, 4]] * 7
    assert table["paired"]["baseline"] == "kl.coef=0"
    for row in table["paired"]["rows"]:
        r = row["retention"]
        assert (f"- {row['setting']}: retention change vs kl.coef=0: {r['mean']:+.1f} points (95% interval "
                f"{r['low']:+.1f}..{r['high']:+.1f}) over 5 seeds") in results
    before = results[results.index("Before training"):].split("\n")[0]
    assert before in docs


def test_forgetting_probes_are_the_probe_runs():
    probes = json.loads((FORGETTING / "probes.json").read_text())["runs"]
    docs = _section((ROOT / "docs/ablation.md").read_text(), "## Where forgetting happens")
    assert len(probes) == 8
    for p in probes:
        change = {k: 100 * (p["eval_after"][k] - p["eval_before"][k]) for k in p["eval_after"]}
        row = (f"| {p['lr'] * 1e4:g}e-4 | {p['schedule']} | {p['seed']} | {100 * p['eval_after']['add']:.1f}% | "
               f"{change['add']:+.1f} | {change['capitals']:+.1f} | {change['opposites']:+.1f} | "
               f"{p['final_kl']:.2f} |")
        assert row in docs, row
    # The sweep's beta-0 runs at seeds 0 and 1 are the 1.2e-4 probes again, bit for bit.
    table = json.loads((FORGETTING / "table.json").read_text())
    sweep = {r["seed"]: r["values"] for c in table["cells"] if c["setting"] == "kl.coef=0" for r in c["runs"]}
    for p in (p for p in probes if p["lr"] == 1.2e-4):
        assert [sweep[p["seed"]][f"{k}/after"] for k in ("add", "capitals", "opposites")] == \
            [p["eval_after"][k] for k in ("add", "capitals", "opposites")]


def _worst_retention_changes(table: dict, anchored: bool) -> list[float]:
    """Each run's worse retention change (capitals or opposites), over the settings with (anchored) or without
    the replay anchor."""
    return [min(r["values"]["capitals/change"], r["values"]["opposites/change"]) for c in table["cells"]
            if ("replay" in c["setting"]) == anchored for r in c["runs"]]


def test_forgetting_counts_are_the_runs():
    """The per-setting counts (task learned: add up >= 10 points; forgot: a retention set down >= 10 points)
    recomputed from every run of table.json, and each setting's range over its seeds."""
    docs = _section((ROOT / "docs/ablation.md").read_text(), "## Where forgetting happens")
    table = json.loads((FORGETTING / "table.json").read_text())
    for cell in table["cells"]:
        vals = [r["values"] for r in cell["runs"]]
        worst = [min(v["capitals/change"], v["opposites/change"]) for v in vals]
        learned = [v["add/change"] >= 10 - 1e-9 for v in vals]
        forgot = [w <= -10 + 1e-9 for w in worst]
        n = len(vals)
        row = (f"| {cell['setting']} | {sum(learned)} of {n} | {sum(forgot)} of {n} | "
               f"{sum(a and b for a, b in zip(learned, forgot))} of {n} | {min(worst):+.1f} |")
        assert row in docs, row

    # and the range (min..max) of each setting over its seeds, from the table's stats
    for cell in table["cells"]:
        st = cell["stats"]
        spans = [f"{st[k]['min']:+.1f}..{st[k]['max']:+.1f}" for k in ("add/change", "capitals/change",
                                                                      "opposites/change")]
        kl = f"{st['final_kl']['min']:.2f}..{st['final_kl']['max']:.2f}"
        assert f"| {cell['setting']} | {' | '.join(spans)} | {kl} |" in docs, cell["setting"]


def test_forgetting_sweep_command_and_time_are_the_tables():
    table = json.loads((FORGETTING / "table.json").read_text())
    docs = " ".join(_section((ROOT / "docs/ablation.md").read_text(), "## Where forgetting happens").split())
    header = " ".join(table["header"])
    assert "--optim.lr 1.2e-4 --optim.warmup_steps 4 --optim.schedule cosine --train.steps 20" in header
    assert "--optim.lr 1.2e-4 --optim.warmup_steps 4 --optim.schedule cosine --train.steps 20" in docs
    assert f"{table['sweep_wall_seconds'] / 60:.0f} min of sweep wall time" in docs


def test_forgetting_every_run_is_the_tables():
    docs = _section((ROOT / "docs/ablation.md").read_text(), "## Where forgetting happens")
    table = json.loads((FORGETTING / "table.json").read_text())
    for cell in table["cells"]:
        runs = sorted(cell["runs"], key=lambda r: r["seed"])
        parts = [f"{v['add/change']:+.1f} / {v['capitals/change']:+.1f} / {v['opposites/change']:+.1f} "
                 f"({v['final_kl']:.2f})" for v in (r["values"] for r in runs)]
        assert f"| {cell['setting']} | " + " | ".join(parts) + " |" in docs, cell["setting"]


def test_quickstart_forgetting_statement_is_the_sweeps():
    quickstart = " ".join(QUICKSTART.read_text().split())
    table = json.loads((FORGETTING / "table.json").read_text())
    rows = {r["setting"]: r["retention"] for r in table["paired"]["rows"]}

    def said(name):
        r = rows[name]
        return f"{r['mean']:+.1f} points (95% interval {r['low']:+.1f}..{r['high']:+.1f})"
    assert (f"{said('kl.coef=0.01')} at beta 0.01, {said('kl.coef=0.1')} at 0.1 and "
            f"{said('kl.controller=adaptive,kl.coef=0.01')} with the adaptive controller") in quickstart
    assert f"{said('kl.coef=0,kl.replay.coef=1')} against beta 0 over 5 seeds" in quickstart
    assert f"--train.steps 20 # {table['sweep_wall_seconds'] / 60:.0f} min on 2 cores" in quickstart
    lost = [-w for w in _worst_retention_changes(table, anchored=False) if -w >= 10 - 1e-9]
    assert f"had runs that lost {min(lost):.1f} to {max(lost):.1f} points of a retention set" in quickstart
    anchored = _worst_retention_changes(table, anchored=True)
    assert f"no anchored run lost more than {-min(anchored):.1f} points" in quickstart


def test_kl_guide_forgetting_advice_is_the_sweeps():
    guide = " ".join((ROOT / "docs/kl_guide.md").read_text().split())
    table = json.loads((FORGETTING / "table.json").read_text())
    anchored = _worst_retention_changes(table, anchored=True)
    assert f"kept every run within {-min(anchored):.1f} points of where it started" in guide
    for row in table["paired"]["rows"]:
        if "replay" not in row["setting"]:  # "no fixed beta ... kept them measurably better": 0 is in every interval
            assert row["retention"]["low"] <= 0 <= row["retention"]["high"], row["setting"]


def test_quickstart_verify_kl_count_and_time_are_the_recorded_run():
    """The quickstart's count of verify-kl's checks and its wall time are those of docs/results/verify_kl.txt."""
    record = (ROOT / "docs/results/verify_kl.txt").read_text()
    passed, total = re.search(r"^verify-kl: PASSED: (\d+)/(\d+) checks passed$", record, flags=re.M).groups()
    wall = re.search(r"^wall time ([\d.]+) s", record, flags=re.M).group(1)
    quickstart = " ".join(QUICKSTART.read_text().split())
    assert passed == total
    assert f"{total} checks ([results/verify_kl.txt](results/verify_kl.txt): {wall} s wall" in quickstart
    guide = " ".join((ROOT / "docs/kl_guide.md").read_text().split())
    assert f"[results/verify_kl.txt](results/verify_kl.txt) ({total} checks, {wall} s wall" in guide


def test_every_policy_loss_the_docs_name_as_trls_is_registered():
    """TRL's loss types docs/explain.md's migration table says klgrpo has are registered policy losses, the help of
    loss.policy_loss names every registered one, and neither that page nor the README says one of them has no
    counterpart."""
    from klgrpo.config.schema import config_help
    from klgrpo.integrations.trl_mapping import map_trl
    from klgrpo.math.policy_loss import POLICY_LOSSES

    explain = " ".join((ROOT / "docs" / "explain.md").read_text().split())
    for name in ("sapo", "vespo"):
        assert f"`loss.policy_loss: {name}`" in explain or f"and `{name}`" in explain
        assert name in POLICY_LOSSES
        assert map_trl({"loss_type": name}).klgrpo_config().loss.policy_loss == name
    assert "no klgrpo counterpart yet" not in explain
    assert "no klgrpo counterpart yet" not in (ROOT / "README.md").read_text()
    lines = config_help().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  --loss.policy_loss "))
    choices, help_line = lines[at], lines[at + 1]
    assert f"[{'|'.join(POLICY_LOSSES)}]" in choices  # read from the registry when shown
    assert not any(name in help_line for name in POLICY_LOSSES), help_line  # a list written out goes stale


def test_distributed_docs_say_what_the_deepspeed_resume_test_checks():
    """The DeepSpeed resume restores AdamW's moments (tests/test_deepspeed_cpu.py compares them), and the page
    quotes no launch time of its own for those tests, but says that their fixture compiles DeepSpeed's op first."""
    page = " ".join((ROOT / "docs/distributed.md").read_text().split())
    test = (ROOT / "tests/test_deepspeed_cpu.py").read_text()
    assert "fresh AdamW moments" not in page and "AdamW's moments included" in page
    assert 'resumed["moments"]' in test
    assert "about 25 s" not in page and "a session fixture compiles it before the first launch" in page
    assert "def shm_op_built" in test and "compiles its `deepspeed_shm_comm` op inside the first launch" not in page


def test_deepspeed_compile_time_is_the_results_file():
    results = (ROOT / "docs" / "results" / "deepspeed_cpu.txt").read_text()
    (seconds,) = re.findall(r"compiled in (\d+) s", results)
    assert "tests/test_deepspeed_cpu.py" in results and "under\nload" in results
    docs = " ".join((ROOT / "docs" / "distributed.md").read_text().split())
    assert f"It took {seconds} s here, measured under load" in docs
    assert f"({seconds} s for the compile and 2 launches passing, measured under load" in docs


def test_readme_ci_time_is_the_recorded_run():
    """The README's CI time is the recorded fresh-clone .ci/run, which passed every part and kept CI's margin."""
    record = (ROOT / "docs/results/ci_run.txt").read_text()
    rc, seconds = re.search(r"^rc=(\d+) seconds=(\d+)$", record, flags=re.M).groups()
    assert rc == "0" and int(seconds) <= 0.7 * 90 * 60  # 30% margin on CI's 90-minute limit
    assert len(re.findall(r"^\d+ passed, .* in [\d.]+s", record, flags=re.M)) == 3  # tests, slow suite, vLLM tests
    assert " failed" not in record and "All checks passed!" in record
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (f"took {seconds} s, {round(int(seconds) / 60)} minutes, on 2 cores "
            "([docs/results/ci_run.txt](docs/results/ci_run.txt))") in text

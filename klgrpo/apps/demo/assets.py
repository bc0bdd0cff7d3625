"""Everything the embedded demo needs, produced locally in seconds and cached: no download.

``prepare_demo_assets(seed)`` builds the char tokenizer, a random tiny Llama, the arithmetic splits,
runs the SFT warm start, and stores the result under the user's cache folder::

    $KLGRPO_CACHE, else $XDG_CACHE_HOME/klgrpo, else ~/.cache/klgrpo
      demo/<key>/                 key = short hash of every setting that changes the result, seed included
        model/                    SFT model + tokenizer (save_pretrained, safetensors)
        train_addition.jsonl      {"prompt", "answer"}: the GRPO training pool
        validation_<skill>.jsonl  {"prompt", "answer"}
        test_<skill>.jsonl        {"prompt", "answer"}: evaluation and retention sets
        replay_subtraction.jsonl  {"prompt"}: unlabeled prompts of the held-out skill
        assets.json               manifest (written last)

The folder is assembled under a temporary name and renamed into place, so an interrupted run never
leaves a half-written cache; a second call with the same settings loads it without training. Processes that
ask at the same time (every rank of ``accelerate launch``) take turns on a lock of ``demo/``: one builds, the
others wait and load what it built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import transformers

from klgrpo.apps.demo.model import build_tiny_model_for, quiet_progress_bars
from klgrpo.apps.demo.sft import SFTSettings, run_sft
from klgrpo.apps.demo.tasks import MAX_NEW_TOKENS, SPLIT_SEED, make_splits, write_jsonl
from klgrpo.apps.demo.tokenizer import CHARACTERS, build_char_tokenizer
from klgrpo.backends.hf import default_cache_root
from klgrpo.errors import KLGRPOError
from klgrpo.store.state_io import folder_lock

#: Bump whenever the layout or the way the assets are produced changes: old caches are then ignored.
FORMAT_VERSION = 1
TRAINED_SKILL = "addition"
HELD_OUT_SKILL = "subtraction"
MANIFEST = "assets.json"


@dataclass(frozen=True)
class ModelSizes:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    max_positions: int = 32


@dataclass(frozen=True)
class DemoSettings:
    """Every setting that changes the demo assets; all of it (plus the seed) enters the cache key."""

    model: ModelSizes = ModelSizes()
    sft: SFTSettings = SFTSettings()
    n_test: int = 200
    n_validation: int = 200
    n_replay: int = 1000


DEFAULT_SETTINGS = DemoSettings()


@dataclass
class DemoAssets:
    model_dir: Path
    """SFT model and tokenizer (AutoModelForCausalLM / AutoTokenizer .from_pretrained)."""
    train_file: Path
    """jsonl {"prompt", "answer"}: the addition train pool."""
    eval_files: dict[str, Path]
    """skill -> jsonl {"prompt", "answer"}: the 200-prompt test sets, never trained on."""
    replay_file: Path
    """jsonl {"prompt"}: subtraction prompts for a replay KL term (disjoint from every test set)."""
    sft_stats: dict
    """What run_sft returned: steps, seconds, val_accuracy history, ..."""
    from_cache: bool
    """True when loaded from an existing cache (no training happened)."""
    val_files: dict[str, Path] = field(default_factory=dict)
    """skill -> jsonl {"prompt", "answer"}: 200-prompt validation sets, disjoint from test and train."""
    max_new_tokens: int = MAX_NEW_TOKENS
    """Tokens a completion needs: 3 answer digits + EOS."""
    cache_dir: Path | None = None
    """The folder holding all of the above."""


def cache_key(seed: int, settings: DemoSettings) -> str:
    """12 hex digits of a hash over the format version, seed, settings, split seed and vocabulary."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, "seed": seed, "settings": asdict(settings), "split_seed": SPLIT_SEED,
         "chars": CHARACTERS},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_demo_assets(
    seed: int = 0,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    settings: DemoSettings | None = None,
) -> DemoAssets:
    """Build (or load from the cache) the SFT model, tokenizer and data files of the demo.

    ``cache_dir`` replaces the default cache root (see :func:`default_cache_root`).
    """
    settings = settings if settings is not None else DEFAULT_SETTINGS
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()) / "demo"
    final = root / cache_key(seed, settings)
    cached = _cached(final, log)
    if cached is not None:
        return cached
    root.mkdir(parents=True, exist_ok=True)
    # One process builds (under `accelerate launch` every rank gets here at once); the others wait, then load.
    with folder_lock(root, on_wait=lambda: log(f"demo assets: waiting for another process to build {final}")):
        return _cached(final, log, " (built by another process)") or _build_into(final, root, seed, settings, log)


def _cached(final: Path, log: Callable[[str], None], note: str = "") -> DemoAssets | None:
    assets = _load(final)
    if assets is not None:
        log(f"demo assets: loaded from cache {final}{note}")
    return assets


def _build_into(final: Path, root: Path, seed: int, settings: DemoSettings, log: Callable[[str], None]) -> DemoAssets:
    """Build the assets in a temporary folder beside ``final`` and rename it into place."""
    if final.exists():
        log(f"demo assets: {final} is incomplete; rebuilding it")
        shutil.rmtree(final)
    start = time.perf_counter()
    log(f"demo assets: building tokenizer, tiny model (seed {seed}), arithmetic data and SFT warm start in {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _build(tmp, seed, settings, log)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same assets first (where folder_lock could not lock); keep theirs.
            if _load(final) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assets = _load(final)
    if assets is None:  # written a moment ago: a disk that lost it, or another process that removed it
        raise KLGRPOError(f"demo assets in {final} did not load back after writing; remove the folder and retry")
    assets.from_cache = False
    log(f"demo assets: ready in {time.perf_counter() - start:.1f} s")
    return assets


def planned_demo_assets(seed: int = 0, cache_dir: str | Path | None = None,
                        settings: DemoSettings | None = None) -> DemoAssets:
    """Where :func:`prepare_demo_assets` keeps (or would build) the assets of ``seed``, without building anything:
    enough to show the demo's resolved config (``klgrpo train --print-config``) on a fresh machine."""
    settings = settings if settings is not None else DEFAULT_SETTINGS
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()) / "demo"
    folder = root / cache_key(seed, settings)
    skills = (TRAINED_SKILL, HELD_OUT_SKILL)
    return DemoAssets(
        model_dir=folder / "model",
        train_file=folder / f"train_{TRAINED_SKILL}.jsonl",
        eval_files={s: folder / f"test_{s}.jsonl" for s in skills},
        replay_file=folder / f"replay_{HELD_OUT_SKILL}.jsonl",
        sft_stats={},
        from_cache=_load(folder) is not None,
        val_files={s: folder / f"validation_{s}.jsonl" for s in skills},
        cache_dir=folder,
    )


def _build(folder: Path, seed: int, settings: DemoSettings, log: Callable[[str], None]) -> None:
    splits = {
        skill: make_splits(skill, settings.n_test, settings.n_validation, settings.n_replay)
        for skill in (TRAINED_SKILL, HELD_OUT_SKILL)
    }
    files: dict[str, str] = {}
    for skill, s in splits.items():
        files[f"test_{skill}"] = write_jsonl(folder / f"test_{skill}.jsonl", s.test.rows()).name
        files[f"validation_{skill}"] = write_jsonl(folder / f"validation_{skill}.jsonl", s.validation.rows()).name
    files["train"] = write_jsonl(folder / f"train_{TRAINED_SKILL}.jsonl", splits[TRAINED_SKILL].train.rows()).name
    replay_rows = [{"prompt": p} for p in splits[HELD_OUT_SKILL].replay.prompts]
    files["replay"] = write_jsonl(folder / f"replay_{HELD_OUT_SKILL}.jsonl", replay_rows).name

    tokenizer = build_char_tokenizer()
    model = build_tiny_model_for(tokenizer, seed, **asdict(settings.model))
    stats = run_sft(
        model,
        tokenizer,
        {skill: s.train for skill, s in splits.items()},
        splits[settings.sft.target_skill].validation,
        settings.sft,
        seed=seed,
        log=log,
    )
    with quiet_progress_bars():
        model.save_pretrained(folder / "model", safe_serialization=True)
    tokenizer.save_pretrained(folder / "model")
    manifest = {
        "format": FORMAT_VERSION,
        "seed": seed,
        "settings": asdict(settings),
        "files": files,
        "sft_stats": stats,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _load(folder: Path) -> DemoAssets | None:
    """The assets in ``folder``, or None when it is missing or incomplete."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files = {name: folder / filename for name, filename in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(p.is_file() for p in files.values()) or not (folder / "model" / "model.safetensors").is_file():
        return None
    skills = (TRAINED_SKILL, HELD_OUT_SKILL)
    return DemoAssets(
        model_dir=folder / "model",
        train_file=files["train"],
        eval_files={s: files[f"test_{s}"] for s in skills},
        replay_file=files["replay"],
        sft_stats=manifest["sft_stats"],
        from_cache=True,
        val_files={s: files[f"validation_{s}"] for s in skills},
        max_new_tokens=MAX_NEW_TOKENS,
        cache_dir=folder,
    )

"""A hub name that cannot be fetched fails at once, in one line naming the field and the fix."""

from __future__ import annotations

import huggingface_hub  # noqa: F401  (imported before the timing: the check itself must be fast)
import pytest

from klgrpo.backends import hf
from klgrpo.errors import ConfigError

FAKE = "nobody-klgrpo-test/no-such-model"


def _fresh_probe(monkeypatch, reachable):
    monkeypatch.setattr(hf, "_hub_reachable", lambda timeout=3.0: reachable)


def test_offline_hub_name_fails_fast_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "_hub_reachable", lambda timeout=3.0: pytest.fail("offline: no network probe"))
    # Fast means: refused before transformers is asked (it would retry the network for 20-60 s).
    for name in ("AutoTokenizer", "AutoModelForCausalLM"):
        monkeypatch.setattr(f"transformers.{name}.from_pretrained",
                            lambda *a, **k: pytest.fail("transformers was asked to load from the hub"))
    for load in (lambda: hf.load_tokenizer(FAKE), lambda: hf.load_causal_lm(FAKE, None, "cpu", None)):
        with pytest.raises(ConfigError) as info:
            load()
        message = str(info.value)
        assert FAKE in message and "HF_HUB_OFFLINE=0" in message and "local model folder" in message
        assert "\n" not in message


def test_unreachable_hub_fails_fast_and_names_the_field(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    _fresh_probe(monkeypatch, reachable=False)
    with pytest.raises(ConfigError, match=r"'nobody.*' \(model\.name_or_path\).*cannot be reached.*local model folder"):
        hf.hub_access(FAKE, "model.name_or_path")


def test_local_folder_and_cached_names_need_no_network(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "_hub_reachable", lambda timeout=3.0: pytest.fail("no probe for a local folder"))
    assert hf.hub_access(str(tiny_model_dir), "model.name_or_path") == {}
    monkeypatch.setattr(hf, "_in_hub_cache", lambda repo, files: True)
    assert hf.hub_access(FAKE, "model.name_or_path") == {"local_files_only": True}


def test_probe_answers_within_its_timeout_for_an_unroutable_endpoint(monkeypatch):
    for variable in hf._PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port on this machine: refused or silent
    hf._hub_reachable.cache_clear()
    try:
        assert hf._hub_reachable(timeout=0.5) is False
    finally:
        hf._hub_reachable.cache_clear()


def test_probe_gives_up_while_the_connection_still_hangs(monkeypatch):
    """A silent network (a name lookup or connect that never returns): the probe answers False at its timeout
    and leaves the hanging attempt behind, instead of waiting for it. No clock is read: the fake connection is
    released only after the probe has answered, so a probe that waited would hang here."""
    import threading

    release = threading.Event()

    def hang(*_a, **_k):
        release.wait()
        raise OSError("released")

    for variable in hf._PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(hf.socket, "create_connection", hang)
    hf._hub_reachable.cache_clear()
    try:
        assert hf._hub_reachable(timeout=0.05) is False
    finally:
        release.set()
        hf._hub_reachable.cache_clear()

"""The embedded demo's assets: char tokenizer, tiny Llama, arithmetic tasks, SFT warm start, cache.

The entry point is :func:`prepare_demo_assets`; submodules are imported lazily so that importing
``klgrpo.apps.demo`` stays cheap.
"""

from __future__ import annotations

__all__ = ["DemoAssets", "DemoSettings", "prepare_demo_assets", "build_char_tokenizer", "build_tiny_model",
           "save_tiny_model_and_tokenizer"]

_WHERE = {
    "DemoAssets": "klgrpo.apps.demo.assets",
    "DemoSettings": "klgrpo.apps.demo.assets",
    "prepare_demo_assets": "klgrpo.apps.demo.assets",
    "build_char_tokenizer": "klgrpo.apps.demo.tokenizer",
    "build_tiny_model": "klgrpo.apps.demo.model",
    "save_tiny_model_and_tokenizer": "klgrpo.apps.demo.model",
}


def __getattr__(name: str):
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'klgrpo.apps.demo' has no attribute {name!r}")

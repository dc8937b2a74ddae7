"""`exspec.demo`: the builder of the built-in demo model pair (`exspec demo-models`).

corpus.py (training text), tokenizer.py, recipe.py (shapes and recipes), train.py and distill.py (the two
training phases), threads.py, cache.py (where the pair lives, lock, atomic writes), build.py (the
orchestration) and measure.py (agreement, acceptance length, latency).

The public names are imported on first use (PEP 562), so that the command line reads recipe.py (the demo pairs
a user may pick, the default one) without importing the builder's torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exspec.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "CHAT_TEMPLATE": "exspec.demo.tokenizer",
    "DemoBuildError": "exspec.demo.recipe",
    "DemoRecipe": "exspec.demo.recipe",
    "EOS_ID": "exspec.demo.tokenizer",
    "FORMAT_VERSION": "exspec.demo.recipe",
    "MARKER": "exspec.demo.cache",
    "ModelShape": "exspec.demo.recipe",
    "PairLocation": "exspec.demo.cache",
    "RECIPES": "exspec.demo.recipe",
    "build_demo_pair": "exspec.demo.build",
    "cached_pair": "exspec.demo.cache",
    "demo_target": "exspec.demo.build",
    "chat_ids": "exspec.demo.tokenizer",
    "default_demo_dir": "exspec.demo.cache",
    "ensure_demo_pair": "exspec.demo.build",
    "locate_pair": "exspec.demo.cache",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from exspec.demo.build import build_demo_pair, demo_target, ensure_demo_pair
    from exspec.demo.cache import MARKER, PairLocation, cached_pair, default_demo_dir, locate_pair
    from exspec.demo.recipe import FORMAT_VERSION, RECIPES, DemoBuildError, DemoRecipe, ModelShape
    from exspec.demo.tokenizer import CHAT_TEMPLATE, EOS_ID, chat_ids

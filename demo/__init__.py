"""`exspec.demo`: the builder of the built-in demo model pair (`exspec demo-models`).

corpus.py (training text), tokenizer.py, recipe.py (shapes and recipes), train.py and distill.py (the two
training phases), threads.py, cache.py (where the pair lives, lock, atomic writes), build.py (the
orchestration) and measure.py (agreement, acceptance length, latency).
"""

from exspec.demo.build import build_demo_pair, ensure_demo_pair
from exspec.demo.cache import MARKER, PairLocation, cached_pair, default_demo_dir, locate_pair
from exspec.demo.recipe import FORMAT_VERSION, RECIPES, DemoBuildError, DemoRecipe, ModelShape
from exspec.demo.tokenizer import CHAT_TEMPLATE, EOS_ID, chat_ids

__all__ = [
    "CHAT_TEMPLATE",
    "DemoBuildError",
    "DemoRecipe",
    "EOS_ID",
    "FORMAT_VERSION",
    "MARKER",
    "ModelShape",
    "PairLocation",
    "RECIPES",
    "build_demo_pair",
    "cached_pair",
    "chat_ids",
    "default_demo_dir",
    "ensure_demo_pair",
    "locate_pair",
]

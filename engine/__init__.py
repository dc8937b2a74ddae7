"""exspec engine: model loading, KV slot pools, draft/verify/accept, sampling. Knows no policy: the scheduler
says which sequence ids run and with how many draft tokens.

The public names are imported on first use (PEP 562), so that a torch-free module of this package
(config.py: EngineConfig, the engine's limits and defaults) is imported without torch by the command line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exspec.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "CapacityError": "exspec.errors",
    "EngineConfig": "exspec.engine.config",
    "ExspecError": "exspec.errors",
    "InvalidRequestError": "exspec.errors",
    "ModelLoadError": "exspec.errors",
    "ModelPair": "exspec.engine.loader",
    "PrefillBatch": "exspec.engine.types",
    "PrefillChunk": "exspec.engine.types",
    "SamplingParams": "exspec.engine.params",
    "SeqOutput": "exspec.engine.types",
    "SpecEngine": "exspec.engine.engine",
    "StepBatch": "exspec.engine.types",
    "StepOutput": "exspec.engine.types",
    "load_model_pair": "exspec.engine.loader",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from exspec.engine.config import EngineConfig
    from exspec.engine.engine import SpecEngine
    from exspec.engine.loader import ModelPair, load_model_pair
    from exspec.engine.params import SamplingParams
    from exspec.engine.types import PrefillBatch, PrefillChunk, SeqOutput, StepBatch, StepOutput
    from exspec.errors import CapacityError, ExspecError, InvalidRequestError, ModelLoadError

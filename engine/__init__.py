"""exspec engine: model loading, KV slot pools, draft/verify/accept, sampling."""

from exspec.engine.config import EngineConfig
from exspec.engine.engine import SpecEngine
from exspec.errors import CapacityError, ExspecError, InvalidRequestError, ModelLoadError
from exspec.engine.loader import ModelPair, load_model_pair
from exspec.engine.params import SamplingParams
from exspec.engine.sequence import Sequence
from exspec.engine.types import PrefillBatch, PrefillChunk, SeqOutput, StepBatch, StepOutput

__all__ = [
    "CapacityError",
    "EngineConfig",
    "ExspecError",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelPair",
    "PrefillBatch",
    "PrefillChunk",
    "SamplingParams",
    "SeqOutput",
    "Sequence",
    "SpecEngine",
    "StepBatch",
    "StepOutput",
    "load_model_pair",
]

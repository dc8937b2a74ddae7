"""exspec engine: model loading, KV slot pools, draft/verify/accept, sampling."""

from engine.config import EngineConfig
from engine.engine import SpecEngine
from engine.errors import CapacityError, ExspecError, InvalidRequestError, ModelLoadError
from engine.loader import ModelPair, load_model_pair
from engine.params import SamplingParams
from engine.sequence import Sequence
from engine.types import PrefillBatch, PrefillChunk, SeqOutput, StepBatch, StepOutput

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

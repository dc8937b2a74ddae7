"""exspec engine: model loading, KV slot pools, draft/verify/accept, sampling. Knows no policy: the scheduler
says which sequence ids run and with how many draft tokens."""

from exspec.engine.config import EngineConfig
from exspec.engine.engine import SpecEngine
from exspec.engine.loader import ModelPair, load_model_pair
from exspec.engine.params import SamplingParams
from exspec.engine.types import PrefillBatch, PrefillChunk, SeqOutput, StepBatch, StepOutput
from exspec.errors import CapacityError, ExspecError, InvalidRequestError, ModelLoadError

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
    "SpecEngine",
    "StepBatch",
    "StepOutput",
    "load_model_pair",
]

"""exspec scheduler: asyncio request queue feeding the EXSPEC sliding pool of same-length groups.

`SamplingParams` is re-exported: what a request asks for is part of the scheduler's interface to the server."""

from exspec.engine.params import SamplingParams
from exspec.scheduler.async_scheduler import AsyncScheduler, RequestStream
from exspec.scheduler.core import EngineProtocol, SchedulerCore
from exspec.scheduler.offline import OfflineResult, RunSummary, generate_offline
from exspec.scheduler.policies import SpeculationPolicy
from exspec.scheduler.policy import BatchChoice, Candidate, choose_batch
from exspec.scheduler.types import QueueFullError, RequestOutput, SchedulerClosedError, SchedulerConfig, StepStats

__all__ = [
    "AsyncScheduler",
    "BatchChoice",
    "Candidate",
    "EngineProtocol",
    "OfflineResult",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "RunSummary",
    "SchedulerClosedError",
    "SchedulerConfig",
    "SamplingParams",
    "SchedulerCore",
    "SpeculationPolicy",
    "StepStats",
    "choose_batch",
    "generate_offline",
]

"""exspec scheduler: asyncio request queue feeding the EXSPEC sliding pool of same-length groups.

`SamplingParams` (with its bounds LOGIT_BIAS_MAX and MAX_LOGPROBS) and `TokenLogprob` are re-exported: what a request
asks for and what it gets back are part of the scheduler's interface to the server.
The public names are imported on first use (PEP 562), so that the torch-free types.py (SchedulerConfig, whose
defaults the command line's settings read) is imported without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exspec.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "AsyncScheduler": "exspec.scheduler.async_scheduler",
    "BatchChoice": "exspec.scheduler.policy",
    "Candidate": "exspec.scheduler.policy",
    "EngineProtocol": "exspec.scheduler.core",
    "LOGIT_BIAS_MAX": "exspec.engine.params",
    "MAX_LOGPROBS": "exspec.engine.params",
    "OfflineResult": "exspec.scheduler.offline",
    "OfflineRun": "exspec.scheduler.offline",
    "QueueFullError": "exspec.scheduler.types",
    "RequestOutput": "exspec.scheduler.types",
    "RequestStream": "exspec.scheduler.async_scheduler",
    "RunSummary": "exspec.scheduler.offline",
    "SchedulerClosedError": "exspec.scheduler.types",
    "SchedulerConfig": "exspec.scheduler.types",
    "SamplingParams": "exspec.engine.params",
    "SchedulerCore": "exspec.scheduler.core",
    "SpeculationPolicy": "exspec.scheduler.policies",
    "StepStats": "exspec.scheduler.types",
    "TokenLogprob": "exspec.engine.types",
    "choose_batch": "exspec.scheduler.policy",
    "generate_offline": "exspec.scheduler.offline",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:
    from exspec.engine.params import LOGIT_BIAS_MAX, MAX_LOGPROBS, SamplingParams
    from exspec.engine.types import TokenLogprob
    from exspec.scheduler.async_scheduler import AsyncScheduler, RequestStream
    from exspec.scheduler.core import EngineProtocol, SchedulerCore
    from exspec.scheduler.offline import OfflineResult, OfflineRun, RunSummary, generate_offline
    from exspec.scheduler.policies import SpeculationPolicy
    from exspec.scheduler.policy import BatchChoice, Candidate, choose_batch
    from exspec.scheduler.types import QueueFullError, RequestOutput, SchedulerClosedError, SchedulerConfig, StepStats

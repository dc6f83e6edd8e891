"""Serving engine: host-side requests, scheduler and metrics; the device step is engine.py."""

from jaxinfer.engine.engine import (
    Engine,
    EngineConfig,
    RequestOutput,
    StreamOutput,
)
from jaxinfer.engine.metrics import (
    SLO,
    MetricsCollector,
    MetricsSummary,
    Percentiles,
    RequestRecord,
    StepRecord,
)
from jaxinfer.engine.request import FinishReason, Request, SeqStatus, Sequence
from jaxinfer.engine.scheduler import (
    Schedule,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SeqOutput,
)

__all__ = [
    # -------------------------------------------------------------------------- engine
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "StreamOutput",
    # ------------------------------------------------------------------------ requests
    "FinishReason",
    "Request",
    "SeqStatus",
    "Sequence",
    # ----------------------------------------------------------------------- scheduler
    "Schedule",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SeqOutput",
    # ------------------------------------------------------------------------- metrics
    "MetricsCollector",
    "MetricsSummary",
    "Percentiles",
    "RequestRecord",
    "SLO",
    "StepRecord",
]

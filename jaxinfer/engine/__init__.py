"""Serving engine: host-side requests, scheduler and metrics (engine.py drives them; the jitted
device functions are step.py, the failed-step undo recovery.py)."""

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.metrics import (
    SLO,
    MetricsCollector,
    MetricsSummary,
    Percentiles,
    RequestRecord,
    StepRecord,
)
from jaxinfer.engine.outputs import RequestOutput, StreamOutput
from jaxinfer.engine.request import FinishReason, Request, SeqStatus, SequenceState
from jaxinfer.engine.scheduler import (
    Schedule,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SeqOutput,
)
from jaxinfer.speculative.config import SpeculativeConfig

__all__ = [
    # -------------------------------------------------------------------------- engine
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SpeculativeConfig",
    "StreamOutput",
    # ------------------------------------------------------------------------ requests
    "FinishReason",
    "Request",
    "SeqStatus",
    "SequenceState",
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

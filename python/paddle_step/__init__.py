"""paddle_step: KV-cache block scheduling and decode-input ops for Paddle,
and a continuous-batching engine that drives them."""

from .check_state import StateError, check_state
from .engine import Engine, GenerationResult, GenerationStats
from .ops import advance_step, step_paddle
from .state import EngineConfig

__all__ = [
    "Engine", "EngineConfig", "GenerationResult", "GenerationStats", "StateError",
    "advance_step", "check_state", "step_paddle",
]

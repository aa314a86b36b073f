"""paddle_step: KV-cache block scheduling and decode-input ops for Paddle."""

from .check_state import StateError, check_state
from .ops import advance_step, step_paddle

__all__ = ["StateError", "advance_step", "check_state", "step_paddle"]

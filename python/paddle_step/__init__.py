"""paddle_step: KV-cache block scheduling and decode-input ops for Paddle."""

from .ops import advance_step, step_paddle

__all__ = ["advance_step", "step_paddle"]

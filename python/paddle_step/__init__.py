"""paddle_step: KV-cache block scheduling and decode-input ops for Paddle,
and a continuous-batching engine that drives them.

Everything loads on first use: ``paddle_step.check_state`` (NumPy only) imports without
paddle or a build, and ``python -m paddle_step.serve`` reaches its stop-signal handlers
before anything heavy imports.
"""

import warnings
from importlib import import_module

# `import paddle` warns "No ccache found" (paddle.utils.cpp_extension looks for a compiler
# cache when it is imported): a concern of whoever builds extensions, not of a user of the
# built ops. Only that message from that module is ignored; paddle is not imported here.
warnings.filterwarnings(
    "ignore",
    message="No ccache found",
    category=UserWarning,
    module=r"paddle\.utils\.cpp_extension\.extension_utils",
)

_LAZY = {
    "StateError": ".spec.check_state",
    "check_state": ".spec.check_state",
    "advance_step": ".ops",
    "step_paddle": ".ops",
    "Engine": ".engine.llm_engine",
    "GenerationResult": ".engine.outputs",
    "GenerationStats": ".engine.outputs",
    "EngineConfig": ".config",
    "SamplingParams": ".sampling_params",
    "ModelConfig": ".config",
    "load_checkpoint": ".model_loader.loader",
    "CheckpointError": ".errors",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'paddle_step' has no attribute '{name}'")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value

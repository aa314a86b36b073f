"""Hugging Face checkpoints: ``config.json`` into a ``ModelConfig`` (``hf_config``), the
safetensors weights (``weights``), and the whole directory into a model and a tokenizer
(``loader.load_checkpoint``, which imports paddle; this package's top does not)."""

from ..errors import CheckpointError

__all__ = ["CheckpointError"]

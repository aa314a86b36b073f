"""Errors shared by several packages. No imports, so any module may raise them."""

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint this package cannot load: what was found and what is supported."""

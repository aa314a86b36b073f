"""Tensor parallelism over ``paddle.distributed``."""

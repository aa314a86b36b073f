"""The identity of a prompt's full KV blocks for automatic prefix caching. No paddle.

A block's key is a hash chain: the SHA-256 of its parent block's key and its own token
ids, so two prompts share the key of block ``i`` exactly when their first ``(i + 1) *
block_size`` tokens are equal (K/V at a position depends on every token before it). A
cryptographic hash keeps a collision, which would hand one prompt another's K/V, out of
reach; Python's ``hash`` of a tuple is 64 bits and chosen for speed, not that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["cacheable_blocks", "prompt_block_hashes"]


def prompt_block_hashes(prompt_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The keys of the prompt's full blocks, block 0 first (a partial last block has none)."""
    tokens = np.asarray(prompt_ids, dtype=np.int64)
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + tokens[start : start + block_size].tobytes()).digest()
        hashes.append(parent)
    return hashes


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks of a prompt a hit may cover: full blocks, leaving at least
    the prompt's last token to compute (its logits give the first output token)."""
    return (prompt_len - 1) // block_size

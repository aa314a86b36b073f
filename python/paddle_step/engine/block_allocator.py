"""Host-side allocator of the encoder (prompt) blocks, the lower KV block ids."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["EncoderBlockAllocator"]


class EncoderBlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1`` whole, lowest free ids first.

    The engine takes a request's prompt blocks here at admission and gives them back when
    the request retires; the decoder pool above them is ``step_paddle``'s business.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(
                f"EncoderBlockAllocator: argument 'num_blocks': expected an int >= 0, "
                f"got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        # A stack with the lowest id on top, so a fresh allocator gives 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks available now."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks handed out and not freed yet."""
        return len(self._allocated)

    @property
    def allocated(self) -> frozenset[int]:
        """The block ids handed out and not freed yet."""
        return frozenset(self._allocated)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` distinct free blocks, or None (taking nothing) when fewer are free."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(
                f"EncoderBlockAllocator.allocate: argument 'count': expected an int >= 0, "
                f"got {count!r}"
            )
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        assert self._allocated.isdisjoint(blocks), f"blocks {blocks} handed out twice"
        self._allocated.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Returns blocks taken from ``allocate``; raises ``ValueError`` (freeing nothing)
        if one is not allocated or is listed twice."""
        blocks = list(blocks)
        not_allocated = [block for block in blocks if block not in self._allocated]
        if not_allocated or len(set(blocks)) != len(blocks):
            raise ValueError(
                f"EncoderBlockAllocator.free: argument 'blocks': expected distinct allocated "
                f"block ids, got {blocks} (not allocated: {not_allocated})"
            )
        self._allocated.difference_update(blocks)
        self._free.extend(reversed(blocks))

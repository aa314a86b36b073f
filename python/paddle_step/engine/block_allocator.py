"""Host-side allocator of the encoder (prompt) blocks, the lower KV block ids, with the
reference counts and the cache of computed prompt blocks that prefix caching shares."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["EncoderBlockAllocator"]


class EncoderBlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1`` whole, lowest free ids first.

    The engine takes a request's prompt blocks here at admission and gives them back when
    the request retires; the decoder pool above them is ``step_paddle``'s business.

    Every handed-out block has a reference count (the requests whose tables hold it).
    ``cache`` names a computed full prompt block by its key (``prefix_cache``); a later
    prompt with the same leading tokens finds it with ``cached_prefix`` and takes a
    reference with ``share``. A cached block nobody references stays cached and is
    reclaimed, least recently released first, only when ``allocate`` runs out of blocks
    that were never cached.
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
        self._ref_counts: dict[int, int] = {}
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        # Cached blocks with no reference, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now (cached ones nobody holds included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_allocated(self) -> int:
        """Blocks some request holds."""
        return len(self._ref_counts)

    @property
    def allocated(self) -> frozenset[int]:
        """The block ids some request holds."""
        return frozenset(self._ref_counts)

    @property
    def num_cached(self) -> int:
        """Blocks a prompt can find by key, held or not."""
        return len(self._key_of_block)

    def ref_count(self, block: int) -> int:
        """How many requests hold ``block`` (0: free or cached only)."""
        return self._ref_counts.get(block, 0)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` distinct blocks, one reference each, or None (taking nothing) when
        fewer are available; evicts unreferenced cached blocks, oldest first, only when
        the never-cached ones run out."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(
                f"EncoderBlockAllocator.allocate: argument 'count': expected an int >= 0, "
                f"got {count!r}"
            )
        if count > self.num_free:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                blocks.append(self._free.pop())
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of_key[self._key_of_block.pop(block)]
                blocks.append(block)
        assert self._ref_counts.keys().isdisjoint(blocks), f"blocks {blocks} handed out twice"
        self._ref_counts.update((block, 1) for block in blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each of ``blocks``; raises ``ValueError`` (changing
        nothing) if one is not held or is listed twice. A block left without reference
        goes back to the free blocks, or, when cached, to the evictable ones."""
        blocks = list(blocks)
        not_allocated = [block for block in blocks if block not in self._ref_counts]
        if not_allocated or len(set(blocks)) != len(blocks):
            raise ValueError(
                f"EncoderBlockAllocator.free: argument 'blocks': expected distinct allocated "
                f"block ids, got {blocks} (not allocated: {not_allocated})"
            )
        released = []
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                del self._ref_counts[block]
                if block in self._key_of_block:
                    self._evictable[block] = None
                else:
                    released.append(block)
        self._free.extend(reversed(released))

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of ``keys`` (no reference taken)."""
        blocks = []
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Takes one more reference to each of ``blocks`` (cached ones, from
        ``cached_prefix``); an unreferenced one stops being evictable."""
        for block in blocks:
            if block not in self._key_of_block:
                raise ValueError(
                    f"EncoderBlockAllocator.share: argument 'blocks': expected cached block "
                    f"ids, got {block} (not cached)"
                )
            if block in self._evictable:
                del self._evictable[block]
            self._ref_counts[block] = self._ref_counts.get(block, 0) + 1

    def cache(self, block: int, key: bytes) -> None:
        """Lets later prompts find the held ``block`` by ``key`` once its K/V is written;
        a key already cached keeps its block (this one stays private to its request)."""
        if block not in self._ref_counts:
            raise ValueError(
                f"EncoderBlockAllocator.cache: argument 'block': expected a held block id, "
                f"got {block}"
            )
        if key in self._block_of_key or block in self._key_of_block:
            return
        self._block_of_key[key] = block
        self._key_of_block[block] = key

    def problems(self) -> list[str]:
        """How the allocator's own books disagree (free, held and evictable blocks
        partition the ids; the key maps are each other's inverse; only cached blocks are
        evictable)."""
        problems = []
        free, held, evictable = set(self._free), set(self._ref_counts), set(self._evictable)
        if len(free) != len(self._free):
            problems.append(f"a block is free twice: {sorted(self._free)}")
        for name, a, b in (
            ("free and held", free, held),
            ("free and evictable", free, evictable),
            ("held and evictable", held, evictable),
        ):
            if a & b:
                problems.append(f"blocks {sorted(a & b)} are both {name}")
        if free | held | evictable != set(range(self.num_blocks)):
            lost = set(range(self.num_blocks)) - free - held - evictable
            problems.append(f"blocks {sorted(lost)} are neither free, held nor evictable")
        if any(count <= 0 for count in self._ref_counts.values()):
            problems.append(f"non-positive reference counts: {self._ref_counts}")
        if {b: k for k, b in self._block_of_key.items()} != self._key_of_block:
            problems.append("the key -> block and block -> key maps disagree")
        if not evictable <= self._key_of_block.keys():
            problems.append(
                f"uncached blocks {sorted(evictable - self._key_of_block.keys())} are evictable"
            )
        if free & self._key_of_block.keys():
            problems.append(f"free blocks {sorted(free & self._key_of_block.keys())} are cached")
        return problems

"""The paged KV cache and the flat batch of one step: positions, slot mapping through the
block tables, writes that skip slot -1, head-major gathers."""

import numpy as np
import paddle
import pytest

from paddle_step.layers.paged_attention import (
    DecodeInputs,
    PagedKVCache,
    RowsRead,
    build_flat_batch,
)
from paddle_step.testing.paged_batches import slot_state


@pytest.mark.parametrize("on_host", [True, False])
def test_build_flat_batch_positions_and_slots(on_host: bool) -> None:
    block_size = 2
    block_tables = paddle.to_tensor([[5, 1], [7, -1], [0, 3], [4, 6], [2, 8]], dtype="int32")
    input_ids, lens, starts = slot_state(
        rows=[[10, 11, 12], [30], [20], [], [40]], starts=[0, 2, 2, 0, 4], width=3
    )
    batch = build_flat_batch(input_ids, lens, starts, block_tables, block_size, on_host)

    assert batch["input_ids"].tolist() == [10, 11, 12, 30, 20, 40]
    assert batch["positions"].tolist() == [0, 1, 2, 2, 2, 4]
    assert batch["token_rows"].tolist() == [0, 0, 0, 1, 2, 4]
    # Row 1's second block is unallocated and row 4's position 4 is past its table: no slot.
    assert batch["slot_mapping"].tolist() == [10, 11, 2, -1, 6, -1]
    assert batch["last_token_index"].tolist() == [2, 3, 4, -1, 5]
    assert batch["max_context_len"] == 5
    assert batch["block_tables"] is block_tables

    with pytest.raises(ValueError, match="no row has tokens"):
        build_flat_batch(
            input_ids, paddle.zeros_like(lens), starts, block_tables, block_size, on_host
        )


@pytest.mark.parametrize("vector_shape", [[4], [4, 1]])
def test_build_flat_batch_names_a_batch_size_that_differs(vector_shape: list[int]) -> None:
    input_ids, lens, starts = slot_state(rows=[[1], [2], [3]], starts=[0, 1, 2], width=2)
    tables = paddle.zeros([3, 2], dtype="int32")
    other = paddle.zeros(vector_shape, dtype="int32")  # 4 slots where the others have 3
    message = "same batch size, got 3, 3, 4 and 3"
    with pytest.raises(ValueError, match=message):
        build_flat_batch(input_ids, lens, other, tables, 2)
    assert build_flat_batch(input_ids, lens.reshape([3, 1]), starts, tables, 2)[
        "positions"
    ].tolist() == [0, 1, 2]


@pytest.mark.parametrize("decode_rows", ["none", "some", "only", "every"])
def test_build_flat_batch_on_host_equals_the_paddle_ops(decode_rows: str) -> None:
    # "only": every row with a token decodes it, some rows idle; "every": the full-batch
    # decode step, whose flat batch the host path takes from the decode inputs as they are.
    with_decode_inputs = decode_rows != "none"
    rng = np.random.default_rng(4)
    decoded = 0
    for block_size, batch, width in [(1, 3, 5), (4, 7, 9), (16, 64, 33)]:
        rows = [rng.integers(0, 500, rng.integers(0, width + 1)).tolist() for _ in range(batch)]
        rows[0] = rows[0] or [1]  # at least one token
        if decode_rows == "some":  # every other row runs one token: decoding or not
            rows[1::2] = [[7] for _ in rows[1::2]]
        if decode_rows == "every":
            rows = [[7] for _ in rows]
        if decode_rows == "only":  # the first row decodes, about half the others idle
            rows = [[7] if i == 0 or rng.random() < 0.5 else [] for i in range(batch)]
        starts = rng.integers(0, 40, batch).tolist()
        tables = rng.integers(-1, 50, (batch, -(-(40 + width) // block_size)))
        state = slot_state(rows, starts, width)
        decode = None
        if with_decode_inputs:  # of the one-token rows, most decode
            active = np.array([len(row) == 1 for row in rows])
            if decode_rows == "some":
                active &= rng.random(batch) < 0.7
            decode = DecodeInputs(*(paddle.to_tensor(a) for a in (
                active, rng.integers(500, 900, batch), rng.integers(40, 90, batch),
                rng.integers(-1, 800, batch))))  # fmt: skip
        args = (*state, paddle.to_tensor(tables, "int32"), block_size)
        host = build_flat_batch(*args, True, decode_inputs=decode)
        ops = build_flat_batch(*args, False, decode_inputs=decode)
        if decode is not None:  # the decoding rows' tokens are the prepared ones
            decoding = decode.active.numpy()[host["token_rows"].numpy()]
            prepared = decode.positions.numpy()[host["token_rows"].numpy()]
            decoded += int(decoding.sum())
            np.testing.assert_array_equal(host["positions"].numpy()[decoding], prepared[decoding])
        assert host.keys() == ops.keys()
        for key in host:
            if isinstance(host[key], paddle.Tensor):
                assert host[key].dtype == ops[key].dtype, key
                np.testing.assert_array_equal(host[key].numpy(), ops[key].numpy(), err_msg=key)
            else:
                assert host[key] == ops[key], key
    assert decoded > 0 or not with_decode_inputs
    if decode_rows == "every":
        assert decoded == 3 + 7 + 64
    if decode_rows == "only":
        assert 3 < decoded < 3 + 7 + 64


def test_slot_minus_one_writes_nothing() -> None:
    cache = PagedKVCache(num_blocks=2, block_size=4, num_layers=2, num_kv_heads=2, head_dim=3)
    k = paddle.arange(18, dtype="float32").reshape([3, 2, 3]) + 1
    v = -k
    cache.write(1, paddle.to_tensor([3, -1, 5], dtype="int64"), k, v)

    keys, values = cache.key.numpy(), cache.value.numpy()
    np.testing.assert_array_equal(keys[1, 3], k.numpy()[0])
    np.testing.assert_array_equal(keys[1, 5], k.numpy()[2])
    np.testing.assert_array_equal(values[1, 5], v.numpy()[2])
    written = np.zeros(keys.shape, dtype=bool)
    written[1, [3, 5]] = True
    # In particular the last slot (where index -1 would wrap) and layer 0 stay empty.
    assert not keys[~written].any() and not values[~written].any()

    rows = cache.head_major_rows(paddle.to_tensor([[5, 3]], dtype="int64"))
    got_k, got_v = cache.gather_head_major(1, rows)
    assert got_k.shape == [1, 2, 2, 3]  # [N, KV heads, K, head_dim]
    np.testing.assert_array_equal(got_k.numpy()[0, :, 0], k.numpy()[2])
    np.testing.assert_array_equal(got_v.numpy()[0, :, 1], v.numpy()[0])

    cache.write(0, paddle.to_tensor([-1, -1, -1], dtype="int64"), k, v)
    assert not cache.key.numpy()[0].any()


def test_a_cache_larger_than_the_available_memory_is_refused_with_its_size(monkeypatch) -> None:
    """Named at once, instead of paddle's ResourceExhausted dump after seconds of trying."""
    import paddle_step.host_memory as host_memory

    # 10 blocks of 4 tokens, 2 layers, 2 KV heads of 8, float32: keys and values 10,240 B.
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 10_239)
    with pytest.raises(MemoryError, match=r"KV cache needs 0.0 GiB \(40 token slots x 2 layers"):
        PagedKVCache(10, 4, 2, 2, 8)
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 10_240)
    assert PagedKVCache(10, 4, 2, 2, 8).key.shape == [2, 40, 2, 8]
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: None)  # not Linux
    assert PagedKVCache(10, 4, 2, 2, 8).value.shape == [2, 40, 2, 8]


def _ints(tensor: paddle.Tensor | None) -> list[int] | None:
    return None if tensor is None else tensor.numpy().tolist()


def test_rows_read_are_the_sampled_and_prompt_logprob_tokens_in_token_order() -> None:
    read = RowsRead(7, paddle.to_tensor([6, -1, 2]), paddle.to_tensor([0, 2, 1]))
    assert _ints(read.output_rows) == [0, 1, 2, 6]
    assert _ints(read.last_token_index) == read.last_rows == [3, -1, 2]  # -1 stays
    assert _ints(read.extra_index) == [0, 2, 1]
    assert _ints(RowsRead(3, paddle.to_tensor([2, 0])).extra_index) is None


def test_rows_read_by_every_token_or_by_none() -> None:
    last = paddle.to_tensor([0, 1, -1, 2])
    every = RowsRead(3, last)  # a decode step: nothing to select
    assert every.output_rows is None and every.last_token_index is last
    assert every.last_rows == [0, 1, -1, 2]
    none = RowsRead(5, paddle.to_tensor([-1, -1]))  # prompt chunks that sample nothing
    assert _ints(none.output_rows) == [0] and _ints(none.last_token_index) == [-1, -1]

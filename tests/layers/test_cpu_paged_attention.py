"""The CPU decode attention and KV-cache write (ops/cpu_paged_attention.cc) against a plain
float64 NumPy reference that walks each token's block-table row. A bfloat16 cache against the
float32 op over the widened values: the same bits."""

import math

import numpy as np
import paddle
import pytest

import paddle_step_ops
from paddle_step.config import ModelConfig
from paddle_step.layers import cpu_linear
from paddle_step.layers.paged_attention import PagedKVCache
from paddle_step.models.llama import FusedStep, LlamaForCausalLM
from paddle_step.testing.cpu_paths import ISA_PATHS, on_isa, runs_here
from paddle_step.testing.weight_formats import bfloat16_bits

# (heads, kv_heads, head_dim, block_size): MHA and GQA groups, head dims off the vector
# widths (8, 16) and on them, blocks of one slot and of several. (4, 2, 27, 8): 11 last dims
# after the 16-lane part, for keys taken 16 at a time.
SHAPES = (
    (1, 1, 1, 1),
    (4, 2, 7, 3),
    (6, 3, 17, 4),
    (14, 2, 64, 16),
    (8, 8, 16, 2),
    (3, 1, 80, 5),
    (4, 2, 27, 8),
)


def reference_attention(q, key, value, tables, rows, positions, block_size, scale):
    """[T, H * D] float64: each token over the keys its table row holds at 0..position."""
    tokens, heads, head_dim = q.shape
    group = heads // key.shape[1]
    out = np.zeros((tokens, heads, head_dim))
    for t in range(tokens):
        slots = []
        for j in range(positions[t] + 1):
            column = j // block_size
            if column < tables.shape[1] and tables[rows[t], column] >= 0:
                slots.append(tables[rows[t], column] * block_size + j % block_size)
        for h in range(heads):
            if not slots:
                continue
            keys = key[slots, h // group].astype(np.float64)
            scores = keys @ q[t, h].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            out[t, h] = weights / weights.sum() @ value[slots, h // group].astype(np.float64)
    return out.reshape(tokens, heads * head_dim)


def random_case(rng, shape, dtype, table_dtype):
    """A cache of 2 layers with random contents, block tables with holes (-1) and columns
    past the end, and decode tokens at positions inside, at and past their tables."""
    heads, kv_heads, head_dim, block_size = shape
    num_blocks, table_width, table_rows = 9, 4, 5
    cache_shape = (2, num_blocks * block_size, kv_heads, head_dim)
    key = rng.standard_normal(cache_shape).astype(dtype)
    value = rng.standard_normal(cache_shape).astype(dtype)
    tables = rng.integers(0, num_blocks, (table_rows, table_width))
    tables[rng.random(tables.shape) < 0.25] = -1
    tables[table_rows - 1] = -1  # a row whose tokens see no key
    rows = np.array([0, 1, 2, 3, 4, 0, 2, 1], np.int64)
    positions = rng.integers(0, table_width * block_size + 3, rows.size).astype(np.int64)
    q = rng.standard_normal((rows.size, heads, head_dim)).astype(dtype)
    return q, key, value, tables.astype(table_dtype), rows, positions


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_float32_matches_reference(float_isa_path, shape, table_dtype):
    rng = np.random.default_rng(sum(shape))
    q, key, value, tables, rows, positions = random_case(rng, shape, np.float32, table_dtype)
    block_size, scale = shape[3], 1 / math.sqrt(shape[2])
    for layer in (0, 1):
        out = paddle_step_ops.cpu_decode_attention(
            paddle.to_tensor(q),
            (paddle.to_tensor(key), paddle.to_tensor(value), layer, paddle.to_tensor(tables),
             paddle.to_tensor(rows), paddle.to_tensor(positions), block_size),
            scale,
        ).numpy()  # fmt: skip
        expected = reference_attention(q, key[layer], value[layer], tables, rows, positions,
                                       block_size, scale)  # fmt: skip
        assert out.dtype == np.float32 and out.shape == expected.shape
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert not np.any(out[rows == 4]), "a token that sees no key gets zeros"


@pytest.mark.parametrize("head_dim, count", [(16, 13), (64, 43), (80, 77), (27, 27)])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_keys_scored_together_get_each_keys_own_dot_product(float_isa_path, head_dim, count,
                                                            cache_dtype):  # fmt: skip
    """AVX2 scores 8 keys at a time and AVX-512 16 (head dims of 16s), the rest one by one:
    with every key the same vector, every score has the same bits only if the grouped sums
    are the lone key's, and then each weight is exactly 1 / count. Value j = e_j (one-hot)
    makes the output those weights. Blocks in shuffled order, so the slots jump."""
    heads, kv_heads, block_size = 4, 2, 4
    rng = np.random.default_rng(head_dim)
    blocks = -(-count // block_size)
    table = rng.permutation(blocks)
    key = np.empty((1, blocks * block_size, kv_heads, head_dim), np.float32)
    key[:] = rng.standard_normal((kv_heads, head_dim))
    value = np.zeros_like(key)
    for j in range(count):
        value[0, table[j // block_size] * block_size + j % block_size, :, j] = 1
    q = 3 * rng.standard_normal((1, heads, head_dim)).astype(np.float32)
    cache = [paddle.to_tensor(a).astype(cache_dtype) for a in (key, value)]
    index = [paddle.to_tensor(a) for a in (table[None].astype(np.int32), np.array([0]),
                                           np.array([count - 1]))]  # fmt: skip
    out = paddle_step_ops.cpu_decode_attention(
        paddle.to_tensor(q), (*cache, 0, *index, block_size), 1 / math.sqrt(head_dim)
    ).numpy()
    expected = np.zeros((1, heads * head_dim), np.float32)
    expected.reshape(heads, head_dim)[:, :count] = np.float32(1 / count)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_float64_matches_reference(shape):
    rng = np.random.default_rng(7 + sum(shape))
    q, key, value, tables, rows, positions = random_case(rng, shape, np.float64, np.int64)
    block_size, scale = shape[3], 1 / math.sqrt(shape[2])
    out = paddle_step_ops.cpu_decode_attention(
        paddle.to_tensor(q),
        (paddle.to_tensor(key), paddle.to_tensor(value), 1, paddle.to_tensor(tables),
         paddle.to_tensor(rows), paddle.to_tensor(positions), block_size),
        scale,
    ).numpy()  # fmt: skip
    expected = reference_attention(q, key[1], value[1], tables, rows, positions, block_size,
                                   scale)  # fmt: skip
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-13)


def bits_of(cache):
    """A bfloat16 tensor's values as uint16 bits (widening to float32 is exact)."""
    return (cache.astype("float32").numpy().view(np.uint32) >> 16).astype(np.uint16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_bfloat16_cache_is_the_float32_op_over_the_widened_values(isa_path, shape, table_dtype):
    """Keys and values widened as they are loaded, then the float32 kernel's operations:
    bit for bit its output over a float32 cache holding the widened values. (1 thread reads
    each token's KV heads as one row, 3 threads one head at a time.)"""
    rng = np.random.default_rng(sum(shape))
    q, key, value, tables, rows, positions = random_case(rng, shape, np.float32, table_dtype)
    block_size, scale = shape[3], 1 / math.sqrt(shape[2])
    caches = [paddle.to_tensor(a).astype("bfloat16") for a in (key, value)]
    widened = [c.astype("float32") for c in caches]
    index = [paddle.to_tensor(a) for a in (tables, rows, positions)]
    threads = cpu_linear.num_threads()
    for layer, count in ((0, 1), (1, 3)):
        cpu_linear.set_num_threads(count)
        try:
            out, expected = (
                paddle_step_ops.cpu_decode_attention(
                    paddle.to_tensor(q), (*pair, layer, *index, block_size), scale
                ).numpy()
                for pair in (caches, widened)
            )
        finally:
            cpu_linear.set_num_threads(threads)
        assert out.dtype == np.float32 and out.shape == expected.shape
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
        reference = reference_attention(q, *(w.numpy()[layer] for w in widened), tables, rows,
                                        positions, block_size, scale)  # fmt: skip
        np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-5)
    assert not np.any(out[rows == 4]), "a token that sees no key gets zeros"


def test_write_kv_rounds_into_a_bfloat16_cache():
    """float32 k and v stored rounded to nearest even (ties to even, overflow to inf, NaN
    kept), at the kept slots of one layer: slot -1 and the other layer keep their values."""
    rng = np.random.default_rng(1)
    shape = (2, 12, 2, 5)
    before = [paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype("bfloat16")
              for _ in range(2)]  # fmt: skip
    key_cache, value_cache = (b.clone() for b in before)
    k, v = rng.standard_normal((2, 4, 2, 5)).astype(np.float32)
    # Exact ties (down to even, up to even), the largest float (rounds to inf), infinities,
    # -0, a denormal, below a tie, and ties of other signs and exponents.
    special = [1 + 2**-8, 1 + 3 * 2**-8, 3.4028235e38, np.inf, -np.inf,
               -0.0, 1e-40, 1 + 2**-9, -1 - 2**-8, 2**-8 + 2**-16]  # fmt: skip
    k[0] = np.array(special, np.float32).reshape(2, 5)
    v[3, 1, 2] = np.nan
    slots = np.array([11, -1, 0, 6], np.int64)
    paddle_step_ops.cpu_write_kv(key_cache, value_cache, 1, paddle.to_tensor(slots),
                                 paddle.to_tensor(k), paddle.to_tensor(v))  # fmt: skip
    for cache, old, new in ((key_cache, before[0], k), (value_cache, before[1], v)):
        expected = bits_of(old)
        for i, slot in enumerate(slots):
            if slot >= 0:
                expected[1, slot] = bfloat16_bits(new[i])
        got = bits_of(cache)
        finite = ~np.isnan(cache.astype("float32").numpy())
        np.testing.assert_array_equal(got[finite], expected[finite])
    rounded = [0x3F80, 0x3F82, 0x7F80, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3F80, 0xBF80, 0x3B80]
    assert bits_of(key_cache)[1, 11].ravel().tolist() == rounded
    nan = value_cache.astype("float32").numpy()[1, 6, 1, 2]
    assert np.isnan(nan) and np.isnan(value_cache.astype("float32").numpy()).sum() == 1


def test_decoder_layer_on_a_bfloat16_cache():
    """The whole layer op (its step's K/V written, then attention) on a bfloat16 cache: the
    cache gets the float32 run's K/V rounded, and the output is bit for bit the float32
    op's over the widened cache (a run that writes nothing: slots -1), and close to the
    float32 cache's own run, whose fresh K/V are not rounded."""
    config = ModelConfig(seed=3)
    model = LlamaForCausalLM(config)
    block_size = 4
    tables = paddle.to_tensor(np.array([[5, 2, 0], [1, 4, -1], [3, -1, -1]], np.int32))
    rows = paddle.to_tensor(np.array([0, 1, 2], np.int64))
    positions = np.array([9, 5, 2], np.int64)
    table_of = tables.numpy()
    slots = np.array([table_of[r, p // block_size] * block_size + p % block_size
                      for r, p in enumerate(positions)], np.int64)  # fmt: skip
    rng = np.random.default_rng(2)
    x = paddle.to_tensor(rng.standard_normal((3, config.hidden_size)).astype(np.float32))
    cache_shape = (1, 6 * block_size, config.num_kv_heads, config.head_dim)
    old = [paddle.to_tensor(rng.standard_normal(cache_shape).astype(np.float32)).astype("bfloat16")
           for _ in range(2)]  # fmt: skip

    def run(key, value, step_slots):
        cache = PagedKVCache(6, block_size, 1, config.num_kv_heads, config.head_dim)
        cache.key, cache.value = key, value
        step = FusedStep(cache, paddle.to_tensor(step_slots), tables, rows,
                         paddle.to_tensor(positions), "")  # fmt: skip
        return model._fused_layers(x, step, 1).numpy()  # layer 0 alone

    rounded = [c.clone() for c in old]
    out = run(*rounded, slots)
    written = [c.astype("float32") for c in old]
    out_float32 = run(*written, slots)
    for cache, float32_cache in zip(rounded, written):
        assert cache.dtype == paddle.bfloat16
        np.testing.assert_array_equal(bits_of(cache), bfloat16_bits(float32_cache.numpy()))
    widened = [c.astype("float32") for c in rounded]
    expected = run(*widened, np.full(3, -1, np.int64))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    np.testing.assert_allclose(out, out_float32, rtol=1e-2, atol=1e-3)


def test_paths_and_thread_counts_agree_closely():
    rng = np.random.default_rng(3)
    shape = (14, 2, 64, 16)
    args = [paddle.to_tensor(a) for a in random_case(rng, shape, np.float32, np.int32)]
    q, key, value, tables, rows, positions = args
    results = {}
    threads = cpu_linear.num_threads()
    try:
        for isa in [path for path in ISA_PATHS[:3] if runs_here(path)]:
            for count in (1, 3):
                cpu_linear.set_num_threads(count)
                with on_isa(isa):
                    results[isa, count] = paddle_step_ops.cpu_decode_attention(
                        q, (key, value, 0, tables, rows, positions, 16), 0.125
                    ).numpy()
    finally:
        cpu_linear.set_num_threads(threads)
    scalar = results["scalar", 1]
    for (isa, count), out in results.items():
        # Paths differ only in the order of the sums inside a dot product.
        np.testing.assert_allclose(out, scalar, rtol=1e-5, atol=1e-6, err_msg=isa)
        # The thread count never changes a result: each task runs whole heads. (With 8
        # tokens, 1 thread reads each token's KV heads as one row; 3 threads split them
        # into one item per head.)
        np.testing.assert_array_equal(out, results[isa, 1], err_msg=f"{isa}, {count} threads")


def test_write_kv_writes_kept_slots_of_one_layer():
    cache = PagedKVCache(num_blocks=3, block_size=4, num_layers=2, num_kv_heads=2, head_dim=5)
    assert cache.uses_cpu_ops
    rng = np.random.default_rng(0)
    k = rng.standard_normal((4, 2, 5)).astype(np.float32)
    v = rng.standard_normal((4, 2, 5)).astype(np.float32)
    slots = np.array([11, -1, 0, 6], np.int64)
    cache.write(1, paddle.to_tensor(slots), paddle.to_tensor(k), paddle.to_tensor(v))
    key, value = cache.key.numpy(), cache.value.numpy()
    expected_key, expected_value = np.zeros_like(key), np.zeros_like(value)
    for i, slot in enumerate(slots):
        if slot >= 0:
            expected_key[1, slot], expected_value[1, slot] = k[i], v[i]
    np.testing.assert_array_equal(key, expected_key)
    np.testing.assert_array_equal(value, expected_value)


def test_write_kv_takes_strided_views():
    """k and v come out of a split of the fused q/k/v product: the cache gets their values."""
    cache = PagedKVCache(num_blocks=2, block_size=2, num_layers=1, num_kv_heads=1, head_dim=3)
    kv = paddle.arange(12, dtype="float32").reshape([2, 2, 3])
    k, v = paddle.split(kv, 2, axis=1)
    cache.write(0, paddle.to_tensor([3, 1]), k, v)
    np.testing.assert_array_equal(cache.key.numpy()[0, [3, 1], 0], kv.numpy()[:, 0])
    np.testing.assert_array_equal(cache.value.numpy()[0, [3, 1], 0], kv.numpy()[:, 1])


# The cache view's items (PagedKVCache.view), in order.
CACHE_VIEW = ("key_cache", "value_cache", "layer", "block_tables", "rows", "positions",
              "block_size")  # fmt: skip


def _args(**changes):
    args = dict(
        q=paddle.zeros([2, 4, 8]),
        key_cache=paddle.zeros([2, 12, 2, 8]),
        value_cache=paddle.zeros([2, 12, 2, 8]),
        layer=1,
        block_tables=paddle.to_tensor([[0, 2], [1, -1]], dtype="int32"),
        rows=paddle.to_tensor([0, 1]),
        positions=paddle.to_tensor([5, 1]),
        block_size=4,
        scale=1.0,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"layer": 2}, "argument 'layer': expected a layer in [0, 2), got 2"),
        ({"q": paddle.zeros([2, 3, 8])}, "argument 'q': expected a multiple of the cache's 2"),
        ({"q": paddle.zeros([2, 4, 8], "float64")}, "argument 'q': expected dtype float32"),
        ({"block_size": 5}, "argument 'block_size': expected a divisor of the cache's 12"),
        ({"block_tables": paddle.to_tensor([[0, 3], [1, -1]], dtype="int32")},
         "argument 'block_tables': expected block ids < 3"),
        ({"q": paddle.zeros([3, 4, 8]), "rows": paddle.to_tensor([0, 0, 1]),
          "positions": paddle.to_tensor([1, 2, 1]),
          "block_tables": paddle.to_tensor([[0, 2], [1, 3]], dtype="int32")},
         "argument 'block_tables': expected block ids < 3 (the cache's blocks) or negative "
         "(unused), got 3 in row 1"),  # tokens of one row share their table's check
        ({"rows": paddle.to_tensor([0, 2])}, "argument 'rows': expected entries in [0, 2)"),
        ({"positions": paddle.to_tensor([5, -1])}, "argument 'positions': expected entries >= 0"),
        ({"rows": paddle.to_tensor([0, 1], dtype="int32")},
         "argument 'rows': expected dtype int64"),
        ({"key_cache": paddle.zeros([2, 12, 2, 8]).transpose([0, 2, 1, 3])},
         "argument 'key_cache'"),
        ({"key_cache": paddle.zeros([2, 12, 2, 8], "bfloat16")},
         "argument 'value_cache': expected dtype bfloat16, got dtype float32"),
        ({"key_cache": paddle.zeros([2, 12, 2, 8], "bfloat16"),
          "value_cache": paddle.zeros([2, 12, 2, 8], "bfloat16"),
          "q": paddle.zeros([2, 4, 8], "float64")},
         "argument 'q': expected dtype float32, got dtype float64"),
        ({"key_cache": paddle.zeros([2, 12, 2, 8], "float16"),
          "value_cache": paddle.zeros([2, 12, 2, 8], "float16")},
         "argument 'key_cache': expected dtype float32 or float64 or bfloat16, got dtype "
         "float16"),
    ],
)  # fmt: skip
def test_decode_attention_names_a_bad_argument(changes, message):
    with pytest.raises(ValueError) as error:
        args = _args(**changes)
        cache = [args[name] for name in CACHE_VIEW]
        paddle_step_ops.cpu_decode_attention(args["q"], tuple(cache), args["scale"])
    assert message in str(error.value)


def test_decode_attention_names_a_short_cache_view():
    args = _args()
    with pytest.raises(
        ValueError,
        match=r"argument 'cache': expected \(key_cache, value_cache, "
        r"layer, block_tables, rows, positions, block_size\), got a tuple of 6",
    ):
        paddle_step_ops.cpu_decode_attention(
            args["q"], tuple(args[name] for name in CACHE_VIEW[:-1]), 1.0
        )


def test_write_kv_names_a_bad_slot():
    cache = paddle.zeros([1, 4, 1, 2])
    with pytest.raises(ValueError, match=r"argument 'slots': expected entries in \[-1, 4\), got 4"):
        paddle_step_ops.cpu_write_kv(cache, paddle.zeros([1, 4, 1, 2]), 0,
                                     paddle.to_tensor([4]), paddle.zeros([1, 1, 2]),
                                     paddle.zeros([1, 1, 2]))  # fmt: skip
    assert not cache.numpy().any()


@pytest.mark.parametrize(
    "cache_dtypes, kv_dtype, message",
    [
        (("bfloat16", "bfloat16"), "float64",
         "argument 'k': expected dtype float32, got dtype float64"),
        (("bfloat16", "bfloat16"), "bfloat16",
         "argument 'k': expected dtype float32, got dtype bfloat16"),
        (("bfloat16", "float32"), "float32",
         "argument 'value_cache': expected dtype bfloat16, got dtype float32"),
        (("float32", "float32"), "float64",
         "argument 'k': expected dtype float32, got dtype float64"),
    ],
)  # fmt: skip
def test_write_kv_names_a_dtype_that_does_not_go_with_the_cache(cache_dtypes, kv_dtype, message):
    key_cache, value_cache = (paddle.zeros([1, 4, 1, 2], dtype) for dtype in cache_dtypes)
    with pytest.raises(ValueError) as error:
        paddle_step_ops.cpu_write_kv(key_cache, value_cache, 0, paddle.to_tensor([1]),
                                     paddle.ones([1, 1, 2], kv_dtype),
                                     paddle.ones([1, 1, 2], kv_dtype))  # fmt: skip
    assert message in str(error.value)
    assert not key_cache.astype("float32").numpy().any()

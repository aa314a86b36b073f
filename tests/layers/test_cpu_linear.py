"""The CPU decode-row product (ops/cpu_linear.cc) against a float64 NumPy reference.

The reference multiplies the same activations by the same weights the kernel uses: W itself
(float32), W rounded to bfloat16, or W's int8 quantization times its scales (both computed
here in NumPy, independently of the packer); the activations are x in float32, except on
the avx512_bf16 path: bfloat16 weights times x rounded to bfloat16 (vdpbf16ps), int8 weights
with one scale per column times x quantized per row (vpdpbusd; ``uint8_quantized_values``).
What remains is float32 rounding in the kernel (a product of two bfloat16 values is exact,
and so are integer sums).

A dot product of K terms accumulated in float32 (one rounding per product and per addition,
or one per FMA) is within ``gamma(K) * sum_k |x_k w_k|`` of the exact value,
``gamma(K) = K u / (1 - K u)`` with ``u = 2**-24``, in any order of summation (Higham,
Accuracy and Stability of Numerical Algorithms, 3.1); adding the bias rounds once more. So
each output must lie within ``(K + 2) u (|x| @ |W| + |bias|)`` of the reference: a bound, not a
fitted tolerance, and far below the error of one wrong or misplaced weight.
"""

import functools
import os

import numpy as np
import paddle
import pytest

from paddle_step.layers import cpu_linear
from paddle_step.testing.cpu_paths import ISA_PATHS, on_isa, runs_here
from paddle_step.testing.weight_formats import bfloat16_bits, bfloat16_values

FORMATS = (("float32", None), ("bfloat16", None), ("int8", None), ("int8", 32))
UNIT_ROUNDOFF = 2.0**-24

# (M, K, N): K and N off the vector widths (8, 16) and the panel width (32), row counts
# around every tile height (AVX-512: 8; AVX2: 2 on a whole panel, 6 on half panels) up to 64,
# and one full-width MLP product.
ROWS = (1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 32, 33, 64)
SHAPES = (
    [(m, 13, 17) for m in ROWS]
    + [(m, 100, 15) for m in ROWS]
    + [(m, 896, 100) for m in (1, 8, 9, 33, 64)]
    + [(17, 100, 1), (3, 13, 100), (2, 1, 33), (7, 896, 4864)]
    # AVX2 with x in tiles: two chunks of rows (96 + 5), three spans of K, a part panel
    + [(101, 300, 45)]
)


def int8_quantized(w, group_size):
    """(q int8 [K, N], scales float32 [ceil(K / group), N]): max |w| / 127 per column and
    group, q = w / scale rounded to nearest even."""
    k, n = w.shape
    groups = -(-k // group_size)
    q = np.zeros((k, n), np.int8)
    scales = np.zeros((groups, n), np.float32)
    for g in range(groups):
        rows = slice(g * group_size, min(k, (g + 1) * group_size))
        scale = np.abs(w[rows]).max(axis=0) / np.float32(127)
        scales[g] = scale
        safe = np.where(scale == 0, np.float32(1), scale)
        q[rows] = np.clip(np.rint(w[rows] / safe), -127, 127).astype(np.int8)
    return q, scales


def effective_weights(w, weight_format, group_size):
    """The weights the kernel computes with for ``w`` in ``weight_format``."""
    if weight_format == "float32":
        return w
    if weight_format == "bfloat16":
        return bfloat16_values(w)
    k = w.shape[0]
    group = k if group_size is None else group_size
    q, scales = int8_quantized(w, group)
    # Exact (float64): the kernel multiplies each weight or each sum by its scale, and
    # either rounding is one of the float32 roundings the bound counts.
    return q.astype(np.float64) * np.repeat(scales, group, axis=0)[:k]


def uint8_quantized_values(x):
    """``x`` [M, K] quantized per row as the avx512_bf16 path's int8 products take it:
    scale = max |x| / 127, q = x / scale rounded to nearest even; q * scale in float64."""
    scale = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = np.clip(np.rint(x / np.where(scale > 0, scale, np.float32(1))), -127, 127)
    return q.astype(np.float64) * scale.astype(np.float64)


def multiplied_activations(x, weight_format, isa, group_size=None):
    """The activations the kernel on path ``isa`` multiplies ``weight_format`` weights by:
    on avx512_bf16, x rounded to bfloat16 for bfloat16 weights (vdpbf16ps) and x quantized
    per row for int8 weights with one scale per column (vpdpbusd)."""
    if isa != "avx512_bf16":
        return x
    if weight_format == "bfloat16":
        return bfloat16_values(x)
    if weight_format == "int8" and (group_size is None or group_size >= x.shape[1]):
        return uint8_quantized_values(x)
    return x


def reference_and_bound(x, weights, bias):
    """The float64 product and the float32 accumulation bound of each of its entries."""
    x64, w64 = x.astype(np.float64), weights.astype(np.float64)
    reference = x64 @ w64
    magnitude = np.abs(x64) @ np.abs(w64)
    if bias is not None:
        reference += bias
        magnitude += np.abs(bias)
    return reference, (x.shape[1] + 2) * UNIT_ROUNDOFF * magnitude


def check_within(y, reference, bound):
    error = np.abs(y.astype(np.float64) - reference)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"error {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst} of {y.shape}"
    )


def check_product(y, x, weights, bias):
    check_within(y, *reference_and_bound(x, weights, bias))


@functools.cache
def shape_case(index):
    """x, W and (every other shape) a bias for SHAPES[index]."""
    m, k, n = SHAPES[index]
    rng = np.random.default_rng(index)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if index % 2 else None
    return x, w, bias


@functools.cache
def packed_case(index, weight_format, group_size):
    """The packed weights of SHAPES[index] in a format: packed once for every path."""
    _, w, _ = shape_case(index)
    return cpu_linear.pack(w, weight_format, group_size)


@functools.cache
def format_case(index, weight_format, group_size, isa):
    """The packed weights and the reference of SHAPES[index] in a format on a path."""
    x, w, bias = shape_case(index)
    weights = effective_weights(w, weight_format, group_size)
    x = multiplied_activations(x, weight_format, isa, group_size)
    return packed_case(index, weight_format, group_size), reference_and_bound(x, weights, bias)


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_products_match_float64_reference(isa_path, weight_format, group_size):
    for index, (m, _, n) in enumerate(SHAPES):
        x, _, bias = shape_case(index)
        packed, (reference, bound) = format_case(index, weight_format, group_size, isa_path)
        y = cpu_linear.linear(
            paddle.to_tensor(x), packed, None if bias is None else paddle.to_tensor(bias)
        )
        assert y.shape == [m, n] and y.dtype == paddle.float32
        check_within(y.numpy(), reference, bound)


def test_isa_paths_and_thread_counts_agree_closely():
    """Every path and thread count gives the same product within the float32 bound; thread
    counts on one path give the same bits (each column is summed by one thread, in order)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 777)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((11, 300)).astype(np.float32))
    packed = cpu_linear.pack_float32(w)
    threads = cpu_linear.num_threads()
    try:
        cpu_linear.set_num_threads(1)
        single = cpu_linear.linear(x, packed).numpy()
        for count in (2, 3, 5):
            cpu_linear.set_num_threads(count)
            assert cpu_linear.num_threads() == count
            np.testing.assert_array_equal(cpu_linear.linear(x, packed).numpy(), single)
    finally:
        cpu_linear.set_num_threads(threads)
    check_product(single, x.numpy(), w, None)


@pytest.mark.parametrize("k", [37, 300])
@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_a_row_computes_the_same_bits_in_any_batch(isa_path, weight_format, group_size, k):
    """Each row of a product of M rows equals that row's product alone, bit for bit, on
    every path: a row's sums run in the order of k whatever tile it is in, and whatever
    form x takes for the tile (from 9 rows, the AVX-512 float32 tiles read x regrouped
    in tiles of 12 rows, the AVX2 tiles in tiles of 6; K = 37 leaves a part of 16
    values). K = 300 takes the AVX2 tiles over several spans of the panel, each
    continuing the sums the one before left in y."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((k, 70)).astype(np.float32)
    bias = paddle.to_tensor(rng.standard_normal(70).astype(np.float32))
    packed = cpu_linear.pack(w, weight_format, group_size)
    x = rng.standard_normal((33, k)).astype(np.float32)
    alone = np.concatenate(
        [cpu_linear.linear(paddle.to_tensor(x[r : r + 1]), packed, bias).numpy() for r in range(33)]
    )
    for m in (8, 9, 12, 13, 25, 33):
        batch = cpu_linear.linear(paddle.to_tensor(x[:m]), packed, bias).numpy()
        np.testing.assert_array_equal(batch, alone[:m], err_msg=f"M = {m}")


def test_int8_groups_that_spans_of_the_panel_cut_in_two(isa_path):
    """Groups of 96 rows of K = 1000: the AVX2 tiles' spans of a panel (256 int8 rows)
    end inside groups, and each span takes up the scale of the group it starts in."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((1000, 45)).astype(np.float32)
    bias = rng.standard_normal(45).astype(np.float32)
    packed = cpu_linear.pack_int8(w, 96)
    weights = effective_weights(w, "int8", 96)
    for m in (1, 3, 8, 13):
        x = rng.standard_normal((m, 1000)).astype(np.float32)
        y = cpu_linear.linear(paddle.to_tensor(x), packed, paddle.to_tensor(bias)).numpy()
        x = multiplied_activations(x, "int8", isa_path, 96)
        check_within(y, *reference_and_bound(x, weights, bias))


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_column_shard_equals_slice_of_full_product(weight_format, group_size):
    """A tensor-parallel column shard packed on its own computes the same bits as the same
    columns of the whole product (scales follow their columns)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((896, 300)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((5, 896)).astype(np.float32))
    full = cpu_linear.linear(x, cpu_linear.pack(w, weight_format, group_size)).numpy()
    for begin, end in ((0, 150), (150, 300), (37, 101)):
        shard = cpu_linear.pack(w[:, begin:end], weight_format, group_size)
        np.testing.assert_array_equal(cpu_linear.linear(x, shard).numpy(), full[:, begin:end])


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_row_shards_sum_to_the_product(isa_path, weight_format, group_size):
    """Tensor-parallel row shards (a slice of K each, packed on its own) give partial
    products whose sum is the whole product within the float32 bound."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((200, 45)).astype(np.float32)
    x = rng.standard_normal((9, 200)).astype(np.float32)
    total = reference = bound = np.zeros((9, 45), np.float64)
    for begin, end in ((0, 67), (67, 131), (131, 200)):
        shard, x_shard = w[begin:end], x[:, begin:end].copy()
        packed = cpu_linear.pack(shard, weight_format, group_size)
        total = total + cpu_linear.linear(paddle.to_tensor(x_shard), packed).numpy()
        part_reference, part_bound = reference_and_bound(
            multiplied_activations(x_shard, weight_format, isa_path, group_size),
            effective_weights(shard, weight_format, group_size),
            None,
        )
        reference, bound = reference + part_reference, bound + part_bound
    check_within(total, reference, bound)


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_a_product_can_run_on_a_lower_path(weight_format, group_size):
    """``linear(..., isa=...)`` runs one product on a path below the process's: the same
    bits as the process set to that path; a path above it is refused."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((101, 70)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((13, 101)).astype(np.float32))
    packed = cpu_linear.pack(w, weight_format, group_size)
    for path in filter(runs_here, ISA_PATHS):
        with on_isa(path):
            expected = cpu_linear.linear(x, packed).numpy()
        np.testing.assert_array_equal(cpu_linear.linear(x, packed, isa=path).numpy(), expected)
    best = cpu_linear.best_isa()
    if best != "scalar":
        with on_isa("scalar"), pytest.raises(ValueError, match="argument 'isa': expected a path"):
            cpu_linear.linear(x, packed, isa=best)


def test_read_sum_and_fma_rate():
    """The benchmark's probes: the sum of an array on every thread, and a positive
    multiply-add rate on every path."""
    import paddle_step_ops

    values = np.random.default_rng(8).random(100_003).astype(np.float32)
    threads = cpu_linear.num_threads()
    try:
        for count in (1, 3):
            cpu_linear.set_num_threads(count)
            total = paddle_step_ops.cpu_read_sum(paddle.to_tensor(values))
            assert abs(total - values.astype(np.float64).sum()) <= 1e-4 * values.sum()
            assert paddle_step_ops.cpu_fma_rate(1000) > 0
    finally:
        cpu_linear.set_num_threads(threads)
    with pytest.raises(ValueError, match="argument 'iterations': expected a positive integer"):
        paddle_step_ops.cpu_fma_rate(0)


def test_packed_layouts():
    """The documented layouts (ops/include/cpu_linear_kernel.h), element by element."""
    rng = np.random.default_rng(3)
    k, n = 7, 40  # two panels, the second 8 columns wide; odd K
    w = rng.standard_normal((k, n)).astype(np.float32)
    padded = np.zeros((k, 64), np.float32)
    padded[:, :n] = w
    panels = padded.reshape(k, 2, 32).transpose(1, 0, 2)  # [panel, k, 32]

    np.testing.assert_array_equal(cpu_linear.pack_float32(w).weights.numpy(), panels)

    bf16 = cpu_linear.pack_bfloat16(w).weights
    assert bf16.dtype == paddle.bfloat16 and bf16.shape == [2, 4, 32, 2]
    rows = np.zeros((2, 8, 32), np.float32)  # K padded to 8 with a zero row
    rows[:, :k] = bfloat16_values(panels)
    expected = rows.reshape(2, 4, 2, 32).transpose(0, 1, 3, 2)  # pairs of rows side by side
    np.testing.assert_array_equal(bf16.astype("float32").numpy(), expected)

    packed = cpu_linear.pack_int8(w, group_size=4)
    q, scales = int8_quantized(padded, 4)
    np.testing.assert_array_equal(packed.weights.numpy(), q.reshape(k, 2, 32).transpose(1, 0, 2))
    np.testing.assert_array_equal(
        packed.scales.numpy(), scales.reshape(2, 2, 32).transpose(1, 0, 2)
    )


@pytest.mark.parametrize("weight_format", cpu_linear.FORMATS)
@pytest.mark.parametrize("k, n", [(7, 40), (33, 65), (1, 1)])
def test_a_transposed_source_packs_the_same(weight_format, k, n):
    """W stored as its transpose [N, K] (a tied LM head's embedding) packs into the same
    panels, scales and sizes as W [K, N] itself; so do bfloat16 bits (each element cast
    alone, so both forms hold the same bits whatever rounding the cast uses)."""
    w = np.random.default_rng(k * n).standard_normal((k, n)).astype(np.float32)
    group = 4 if weight_format == "int8" else None
    pairs = [(w, np.ascontiguousarray(w.T))]
    if weight_format == "bfloat16":
        pairs.append(tuple(paddle.to_tensor(a).astype("bfloat16") for a in pairs[0]))
    for source, transposed in pairs:
        plain = cpu_linear.pack(source, weight_format, group)
        packed = cpu_linear.pack(transposed, weight_format, group, transposed=True)
        assert (packed.k, packed.n, packed.group_size) == (k, n, plain.group_size)
        np.testing.assert_array_equal(
            packed.weights.astype("float32").numpy(), plain.weights.astype("float32").numpy()
        )
        if weight_format == "int8":
            np.testing.assert_array_equal(packed.scales.numpy(), plain.scales.numpy())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k, n", [(7, 40), (33, 65)])
def test_int8_from_bfloat16_bits_quantizes_the_values_they_hold(k, n, transposed):
    """A bfloat16 checkpoint quantized at load: int8 packed from the bits equals int8 packed
    from the same values in float32."""
    w = bfloat16_values(np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32))
    stored = np.ascontiguousarray(w.T) if transposed else w
    bits = paddle.to_tensor(bfloat16_bits(stored))
    assert bits.dtype == paddle.bfloat16
    from_bits = cpu_linear.pack_int8(bits, group_size=4, transposed=transposed)
    from_floats = cpu_linear.pack_int8(w, group_size=4)
    np.testing.assert_array_equal(from_bits.weights.numpy(), from_floats.weights.numpy())
    np.testing.assert_array_equal(from_bits.scales.numpy(), from_floats.scales.numpy())


def test_bfloat16_weights_are_kept_exactly():
    rng = np.random.default_rng(4)
    w = paddle.to_tensor(rng.standard_normal((33, 50)).astype(np.float32)).astype("bfloat16")
    x = rng.standard_normal((4, 33)).astype(np.float32)
    packed = cpu_linear.pack_bfloat16(w)
    y = cpu_linear.linear(paddle.to_tensor(x), packed).numpy()
    x = multiplied_activations(x, "bfloat16", cpu_linear.isa())
    check_product(y, x, w.astype("float32").numpy(), None)


@pytest.mark.parametrize("weight_format, group_size", FORMATS)
def test_prefetch_distance_never_changes_a_product(isa_path, weight_format, group_size):
    # One row and several, on the tile heights of every path; the distances span none, one
    # line, past the end of the panels and the largest allowed.
    cases = [i for i, (m, k, _) in enumerate(SHAPES) if k == 896 or m in (1, 7, 13)]
    kept = cpu_linear.prefetch_bytes()
    try:
        for index in cases:
            x, _, bias = shape_case(index)
            packed = packed_case(index, weight_format, group_size)
            args = (paddle.to_tensor(x), packed, None if bias is None else paddle.to_tensor(bias))
            outputs = []
            for distance in (0, 64, 16384, 65536):
                l2 = cpu_linear.Prefetch(distance, 65536 - distance)
                cpu_linear.set_prefetch_bytes(l2, l2)
                outputs.append(cpu_linear.linear(*args).numpy())
                cpu_linear.set_prefetch_bytes(distance, 65536 - distance)
                outputs.append(cpu_linear.linear(*args).numpy())
            for y in outputs[1:]:
                np.testing.assert_array_equal(y, outputs[0])
    finally:
        cpu_linear.set_prefetch_bytes(*kept)


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    holds = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(bound, 16) for bound in head.split("-"))
                holds = low <= address < high
            elif holds and head == "VmFlags:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages"
)
@pytest.mark.parametrize("weight_format", cpu_linear.FORMATS)
def test_packs_ask_for_huge_pages(weight_format):
    """The packs are written into fresh memory at load: asked to be backed by 2 MB pages
    (``hg``, madvise's MADV_HUGEPAGE), each 2 MB of them costs one page fault, not 512."""
    huge = 2 << 20
    packed = cpu_linear.pack(paddle.ones([1024, 4096]), weight_format)  # 4 to 16 MB
    first_whole_page = -(-packed.weights.data_ptr() // huge) * huge
    assert "hg" in vm_flags(first_whole_page)


def test_rows_of_a_wider_matrix_need_no_copy():
    rng = np.random.default_rng(5)
    wide = paddle.to_tensor(rng.standard_normal((6, 120)).astype(np.float32))
    w = rng.standard_normal((40, 70)).astype(np.float32)
    x = wide[:, 30:70]
    y = cpu_linear.linear(x, cpu_linear.pack_float32(w)).numpy()
    check_product(y, x.numpy(), w, None)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 10)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((3, 16)).astype(np.float32))
    packed = cpu_linear.pack_float32(w)
    int8 = cpu_linear.pack_int8(w)
    int32_panels = paddle.zeros([1, 16, 32], "int32")
    linear, pack = cpu_linear.linear, cpu_linear.pack
    cases = [
        ("'x': expected dtype float32, got dtype float64", linear, x.astype("float64"), packed),
        (r"'x': expected shape \[-1, -1\], got shape \[48\]", linear, x.reshape([48]), packed),
        (r"'weights': expected shape \[1, 15, 32\], got shape \[1, 16, 32\]",
         linear, x[:, :15].contiguous(), packed),
        ("'x': expected a matrix whose rows are contiguous", linear, x.T, packed),
        (r"'bias': expected shape \[10\], got shape \[11\]",
         linear, x, packed, paddle.zeros([11])),
        ("'bias': expected dtype float32, got dtype int64",
         linear, x, packed, paddle.zeros([10], dtype="int64")),
        ("'scales': expected the float32 scales of the int8 weights, got none",
         linear, x, cpu_linear.PackedWeights("int8", 16, 10, int8.weights)),
        ("'scales': expected none for float32 weights, got a tensor",
         linear, x, cpu_linear.PackedWeights("float32", 16, 10, packed.weights, int8.scales)),
        ("'weights': expected dtype float32 or bfloat16 or int8, got dtype int32",
         linear, x, cpu_linear.PackedWeights("float32", 16, 10, int32_panels)),
        ("'w': expected dtype float32, got dtype float64", pack, w.astype(np.float64)),
        (r"'w': expected shape \[-1, -1\], got shape \[10\]", pack, w[0], "int8"),
        ("'w': expected a contiguous tensor", pack, paddle.to_tensor(w).T),
        ("'group_size': expected a positive integer, got 0", pack, w, "int8", 0),
        ("'group_size': expected None for 'bfloat16' weights", pack, w, "bfloat16", 4),
        ("'weight_format': expected one of", pack, w, "float16"),
        ("'threads': expected a positive integer, got 0", cpu_linear.set_num_threads, 0),
        ("'isa': expected one of auto, scalar, avx2, avx512, avx512_bf16, got 'sse'",
         cpu_linear.set_isa, "sse"),
        ("'one_row': expected a multiple of 64 from 0 to 65536, got -64",
         cpu_linear.set_prefetch_bytes, -64, 0),
        ("'several_rows': expected a multiple of 64 from 0 to 65536, got 100",
         cpu_linear.set_prefetch_bytes, 0, 100),
        ("'several_rows': expected a multiple of 64 from 0 to 65536, got 65600",
         cpu_linear.set_prefetch_bytes, 64, 65600),
        ("'l2_one_row': expected a multiple of 64 from 0 to 65536, got 32",
         cpu_linear.set_prefetch_bytes, cpu_linear.Prefetch(64, 32), 0),
        ("'l2_several_rows': expected a multiple of 64 from 0 to 65536, got 131072",
         cpu_linear.set_prefetch_bytes, 0, cpu_linear.Prefetch(0, 131072)),
    ]  # fmt: skip
    kept = cpu_linear.prefetch_bytes()
    for match, call, *args in cases:
        with pytest.raises(ValueError, match="argument " + match):
            call(*args)
    assert cpu_linear.prefetch_bytes() == kept  # a refused setting changes nothing

"""Steps whose layers run as one CPU call (``LlamaForCausalLM._fused_layers``,
ops/cpu_decoder_layer.cc) against the same steps through the eager blocks and the
per-layer attention: prompts from position 0, a prompt chunk continued from the cache,
decode tokens, and all three in one step. The same logits and the same K/V written, up
to float32 rounding, for every weight format and instruction-set path."""

from __future__ import annotations

import math
import time

import numpy as np
import paddle
import pytest

from paddle_step.config import ModelConfig
from paddle_step.layers import dense_blocks
from paddle_step.layers.dense_blocks import LayerFusion, padded_rows
from paddle_step.layers.paged_attention import PagedKVCache, build_flat_batch
from paddle_step.models import llama
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.testing.cpu_paths import runs_here
from paddle_step.testing.paged_batches import scrambled_block_tables, slot_state

CONFIGS = {
    "llama-gqa": ModelConfig(seed=3),
    # Qwen2-like biases, an odd group of query heads per KV head, a head_dim off the vector
    # widths and an intermediate size off the panel width.
    "biases-odd": ModelConfig(seed=5, hidden_size=60, num_heads=6, num_kv_heads=2,
                              intermediate_size=100, qkv_bias=True, o_proj_bias=True),
    "mha": ModelConfig(seed=9, hidden_size=48, num_heads=3, num_kv_heads=3,
                       intermediate_size=72, tie_word_embeddings=True),
}  # fmt: skip


STEP_TOKENS = ((9, 17, 0, 4), (1, 3, 6, 0), (1, 1, 1, 0))  # per row, in each step


def count_fused_calls(monkeypatch) -> list[int]:
    """The layer count of each ``_fused_layers`` call from now on."""
    calls = []
    fused_layers = LlamaForCausalLM._fused_layers

    def counted(model, x, step, layers, output_rows=None):
        calls.append(layers)
        return fused_layers(model, x, step, layers, output_rows)

    monkeypatch.setattr(LlamaForCausalLM, "_fused_layers", counted)
    return calls


def fused_steps(model, fused: bool | None, monkeypatch) -> tuple[np.ndarray, ...]:
    """Three steps (``STEP_TOKENS``): prompts from position 0 (one row left empty); then a
    decode token, a chunk of three prompt tokens, a new prompt and an empty row; then a
    decode token each. Layers fused or not (None: as ``fuse_layers`` says). Each step's
    logits, and the caches after the last."""
    calls = count_fused_calls(monkeypatch)
    if fused is not None:
        monkeypatch.setattr(LayerFusion, "fuse_layers", lambda self, rows: fused)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def tokens(*counts: int) -> list[list[int]]:
        return [rng.integers(0, vocab, n).tolist() for n in counts]

    block_size, width = 4, 24
    tables = paddle.to_tensor(scrambled_block_tables(4, math.ceil(width / block_size)))
    cache = PagedKVCache.for_config(model.config, num_blocks=tables.size, block_size=block_size)
    starts = [0] * 4
    outputs = []
    for step in (tokens(*counts) for counts in STEP_TOKENS):
        batch = build_flat_batch(*slot_state(step, starts, width), tables, block_size)
        outputs.append(model.forward_paged(**batch, kv_cache=cache).numpy())
        starts = [start + len(row) for start, row in zip(starts, step)]
    if fused is not None:  # one call a step, of every layer
        assert calls == ([model.config.num_layers] * 3 if fused else [])
    return (*outputs, cache.key.numpy(), cache.value.numpy())


def assert_same_steps(fused: tuple[np.ndarray, ...], blocks: tuple[np.ndarray, ...]) -> None:
    """``fused_steps`` outputs, fused against the blocks: logits, then the caches."""
    for logits, expected in zip(fused[:3], blocks[:3]):
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)
    assert not fused[0][2].any() and not fused[1][3].any()  # the empty rows
    for cache, expected in zip(fused[3:], blocks[3:]):
        np.testing.assert_allclose(cache, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("weight_format", [None, "bfloat16", "int8"])
def test_fused_steps_match_the_blocks(isa_path, name, weight_format, monkeypatch):
    if weight_format is not None:
        # One way for both (avx512_bf16 has two for packed weights, and fuse_layers is
        # forced here, before the blocks have measured theirs).
        monkeypatch.setenv("PADDLE_STEP_DENSE", "op")
    config = CONFIGS[name]
    config = ModelConfig(**{**config.__dict__, "weight_format": weight_format})
    model = LlamaForCausalLM(config)
    assert_same_steps(fused_steps(model, True, monkeypatch), fused_steps(model, False, monkeypatch))


def test_layers_fuse_where_both_blocks_run_the_op_or_where_timed_faster():
    model = LlamaForCausalLM(ModelConfig(seed=1))
    blocks, fusion = model.blocks, model.fusion
    for block in blocks.layer_blocks:
        if "op" not in block.methods:
            pytest.skip("this build has no CPU op")
        block.choice.clear()
    assert fusion.fuse_layers(3) is None  # to do: the blocks have not measured 3 rows yet
    rows_class = padded_rows(3)
    blocks.attention_inputs.choice[rows_class] = "op"
    blocks.output_and_mlp.choice[rows_class] = "eager"
    assert fusion.fuse_layers(3) is None  # to time, both ways
    fusion.choice[rows_class] = False
    assert fusion.fuse_layers(3) is False
    fusion.choice[rows_class] = True
    assert fusion.fuse_layers(3) is True
    blocks.output_and_mlp.forced = "eager"
    assert fusion.fuse_layers(3) is False  # forced to run the blocks
    blocks.output_and_mlp.forced = None
    blocks.output_and_mlp.choice[rows_class] = "op"
    fusion.choice[rows_class] = False
    assert fusion.fuse_layers(3) is True  # the same products: no timing needed


@pytest.mark.parametrize("fused_faster", [True, False])
@pytest.mark.parametrize("blocks_measured", [True, False])
def test_fusion_times_the_first_layers_keeps_the_faster_and_runs_it_last(
    fused_faster, blocks_measured
):
    model = LlamaForCausalLM(ModelConfig(seed=1, num_layers=17))
    blocks = model.blocks
    if "op" not in blocks.output_and_mlp.methods:
        pytest.skip("this build has no CPU op")
    fusion, calls = model.fusion, []
    assert fusion.timed_layers == 17 // dense_blocks.FUSION_LAYERS_DIVISOR
    for block in blocks:
        block.choice.clear()

    def way(name: str, seconds: float):
        def run(layers):
            calls.append((name, layers))
            if name == "blocks":  # as the blocks' first call of a class would
                for block in blocks:
                    block.choice.setdefault(padded_rows(5), "eager")
            time.sleep(seconds)
            return name

        return run

    if blocks_measured:
        way("blocks", 0)(None)
        calls.clear()
    fused = way("fused", 0.0 if fused_faster else 0.05)
    slow_blocks = way("blocks", 0.05 if fused_faster else 0.0)
    assert fusion.choose(5, slow_blocks, fused) == ("fused" if fused_faster else "blocks")
    assert fusion.choice == {padded_rows(5): fused_faster}
    timed = [("blocks", fusion.timed_layers), ("fused", fusion.timed_layers)]
    expected = timed * dense_blocks.FUSION_ROUNDS + [("fused" if fused_faster else "blocks", None)]
    assert calls == expected if blocks_measured else calls == [("blocks", 1), *expected]


def test_one_slow_run_does_not_decide_the_fusion():
    # A burst of another job slows the fused layers' first timed run: their other run
    # still shows them the faster.
    blocks = LlamaForCausalLM(ModelConfig(seed=1)).blocks
    if "op" not in blocks.output_and_mlp.methods:
        pytest.skip("this build has no CPU op")
    fusion, delays = LayerFusion(blocks, num_layers=2), [0.08, 0.0, 0.0]
    for block in blocks:
        block.choice[padded_rows(6)] = "eager"

    def fused(_layers):
        time.sleep(delays.pop(0))
        return "fused"

    def slow_blocks(_layers):
        time.sleep(0.03)
        return "blocks"

    assert fusion.choose(6, slow_blocks, fused) == "fused"
    assert fusion.choice == {padded_rows(6): True}


def test_fusion_runs_fused_where_the_blocks_keep_our_op_on_their_first_call():
    blocks = LlamaForCausalLM(ModelConfig(seed=1)).blocks
    if "op" not in blocks.output_and_mlp.methods:
        pytest.skip("this build has no CPU op")
    fusion, calls = LayerFusion(blocks, num_layers=2), []

    def measured_blocks(layers):
        calls.append(("blocks", layers))
        for block in blocks:
            block.choice[padded_rows(7)] = "op"
        return "blocks"

    def fused(layers):
        calls.append(("fused", layers))
        return "fused"

    assert fusion.choose(7, measured_blocks, fused) == "fused"
    assert calls == [("blocks", 1), ("fused", None)] and not fusion.choice  # nothing timed


def test_a_step_times_both_ways_once_where_the_blocks_keep_another(monkeypatch):
    """Blocks that keep ``eager`` for a class: its first step runs both ways and keeps one;
    the steps' logits and caches equal the blocks' alone."""
    model = LlamaForCausalLM(CONFIGS["biases-odd"])
    if "op" not in model.blocks.output_and_mlp.methods:
        pytest.skip("this build has no CPU op")
    expected = fused_steps(model, False, monkeypatch)
    monkeypatch.undo()
    for block in model.blocks:
        block.choice.update({padded_rows(sum(counts)): "eager" for counts in STEP_TOKENS})
    timed = []
    choose = LayerFusion.choose
    monkeypatch.setattr(
        LayerFusion, "choose", lambda self, *a: timed.append(a[0]) or choose(self, *a)
    )
    steps = fused_steps(model, None, monkeypatch)
    assert timed == [sum(counts) for counts in STEP_TOKENS]
    assert set(model.fusion.choice) == {padded_rows(t) for t in timed}
    assert_same_steps(steps, expected)


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
@pytest.mark.parametrize("way", ["op", "op_widened"])
def test_fused_products_run_the_way_the_blocks_keep(weight_format, way, monkeypatch):
    """Packed weights where the op has dot products (avx512_bf16): a fused layer's products
    run the way both blocks keep (``op_path``), so the fused steps equal the blocks' steps
    (the other way's activations are rounded differently: off by far more than this)."""
    if not runs_here("avx512_bf16"):
        pytest.skip("packed weights have one way below avx512_bf16")
    monkeypatch.setenv("PADDLE_STEP_DENSE", way)
    config = ModelConfig(**{**CONFIGS["biases-odd"].__dict__, "weight_format": weight_format})
    model = LlamaForCausalLM(config)
    assert model.fusion.fuse_layers(1)
    assert model.fusion.op_path(1) == ("avx512" if way == "op_widened" else "")
    assert_same_steps(fused_steps(model, True, monkeypatch), fused_steps(model, False, monkeypatch))


def test_layers_fuse_where_both_blocks_keep_the_same_op_way():
    model = LlamaForCausalLM(ModelConfig(seed=1))
    blocks, fusion = model.blocks, model.fusion
    rows_class = padded_rows(3)
    for first, second, fused in (
        ("op_widened", "op_widened", True),
        ("op", "op_widened", None),  # to time
        ("op_widened", "eager", None),
    ):
        blocks.attention_inputs.choice[rows_class] = first
        blocks.output_and_mlp.choice[rows_class] = second
        assert fusion.fuse_layers(3) is fused, (first, second)
    assert fusion.op_path(3) == ""  # the blocks differ
    blocks.output_and_mlp.choice[rows_class] = "op_widened"
    assert fusion.op_path(3) == "avx512"


def test_prompt_tokens_without_a_slot_run_the_blocks(monkeypatch):
    """A prompt token past its block table has no cache slot, so the cache cannot give it
    its own key: that step runs the blocks (which attend over the step's own K/V)."""
    model = LlamaForCausalLM(CONFIGS["llama-gqa"])
    calls = count_fused_calls(monkeypatch)
    monkeypatch.setattr(LayerFusion, "fuse_layers", lambda self, rows: True)
    tables = scrambled_block_tables(2, 2)
    tables[1, 1] = -1  # row 1's tokens 4.. have no slot
    cache = PagedKVCache.for_config(model.config, num_blocks=tables.size, block_size=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    batch = build_flat_batch(*slot_state(prompts, [0, 0], 8), paddle.to_tensor(tables), 4)
    assert (batch["slot_mapping"].numpy() < 0).any()
    logits = model.forward_paged(**batch, kv_cache=cache).numpy()
    assert not calls
    expected = model.forward_naive(prompts[1:]).numpy()[0]
    np.testing.assert_allclose(logits[1], expected, rtol=1e-4, atol=1e-5)


def _dummy_step(cache_items: int = 7) -> tuple:
    """A step tuple of the right form (the binding only unpacks it)."""
    t = paddle.zeros([1])
    return (t, t, t, (t, t, 0, t, t, t, 4)[:cache_items])


SHAPE = (1, 1, 2, 1e-6)  # heads, kv_heads, head_dim, eps


@pytest.mark.parametrize(
    "layers, shape, step, message",
    [
        ((), (1, 1, 2), None, "argument 'shape': expected (heads, kv_heads, head_dim, eps), "
                              "got a tuple of 3"),
        (((),), SHAPE, None, "argument 'weights': expected (attn_norm, qkv, o, mlp_norm, "
                             "gate_up, down), got a tuple of 0"),
        ((), SHAPE, (1, 2), "argument 'step': expected (cos_table, sin_table, slots, cache), "
                            "got a tuple of 2"),
        ((), SHAPE, _dummy_step(6), "argument 'cache': expected (key_cache, value_cache, "
         "layer, block_tables, rows, positions, block_size), got a tuple of 6"),
    ],
)  # fmt: skip
def test_decoder_stack_names_a_tuple_of_the_wrong_size(layers, shape, step, message):
    with pytest.raises(ValueError) as error:
        stack = llama.paddle_step_ops.DecoderStack(layers, shape)
        stack(paddle.zeros([1, 4]), step, 0)
    assert f"cpu_decoder_layers: {message}" in str(error.value)


def decode_step(model: LlamaForCausalLM, tokens: int = 3, position: int = 9):
    """``tokens`` decode tokens at ``position`` in rows of their own, their hidden states,
    and a fresh cache holding the K/V of every earlier position: (x, FusedStep)."""
    config, block_size = model.config, 4
    rng = np.random.default_rng(11)
    blocks_per_row = position // block_size + 1
    tables = np.arange(tokens * blocks_per_row, dtype=np.int32).reshape(tokens, blocks_per_row)
    cache = PagedKVCache.for_config(config, num_blocks=tables.size, block_size=block_size)
    cache.key.set_value(rng.standard_normal(cache.key.shape).astype(np.float32))
    cache.value.set_value(rng.standard_normal(cache.value.shape).astype(np.float32))
    positions = np.full(tokens, position, np.int64)
    slots = tables[:, position // block_size].astype(np.int64) * block_size + position % block_size
    step = llama.FusedStep(cache, paddle.to_tensor(slots), paddle.to_tensor(tables),
                           paddle.to_tensor(np.arange(tokens, dtype=np.int64)),
                           paddle.to_tensor(positions), "")  # fmt: skip
    x = rng.standard_normal((tokens, config.hidden_size)).astype(np.float32)
    return paddle.to_tensor(x), step


def test_a_stack_equals_its_layers_run_one_call_each():
    """A model's layers in one call: bit for bit the hidden states and caches of each
    layer run as a one-layer stack on its own cache layer, in turn."""
    model = LlamaForCausalLM(ModelConfig(**{**CONFIGS["biases-odd"].__dict__, "num_layers": 3}))
    cfg = model.config
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps)
    x, step = decode_step(model)
    whole = model._fused_layers(x, step, 3).numpy()
    caches = (step.kv_cache.key.numpy(), step.kv_cache.value.numpy())

    x, step = decode_step(model)  # the same inputs, a fresh cache
    cos, sin = model._rope_table(step.positions, flat=True)
    for index, layer in enumerate(model.layers):
        one = llama.paddle_step_ops.DecoderStack((layer.fused_weights(""),), shape)
        view = step.kv_cache.view(index, step.block_tables, step.rows, step.positions)
        x = one(x, (cos, sin, step.slots, view), 1)
    np.testing.assert_array_equal(whole.view(np.uint32), x.numpy().view(np.uint32))
    for cache, layered in zip(caches, (step.kv_cache.key, step.kv_cache.value)):
        np.testing.assert_array_equal(cache.view(np.uint32), layered.numpy().view(np.uint32))


def test_a_stack_runs_the_layers_asked_for_and_names_a_bad_count_or_position():
    model = LlamaForCausalLM(CONFIGS["llama-gqa"])
    layers = model.config.num_layers
    x, step = decode_step(model)
    first = model._fused_layers(x, step, 1).numpy()
    x, step = decode_step(model)
    assert not np.array_equal(first, model._fused_layers(x, step, layers).numpy())
    untouched = model._fused_layers(x, step, 0)
    np.testing.assert_array_equal(untouched.numpy(), x.numpy())
    assert untouched.data_ptr() != x.data_ptr()  # a copy, never x itself
    for count in (-1, layers + 1):
        with pytest.raises(ValueError) as error:
            model._fused_layers(x, step, count)
        assert (f"cpu_decoder_layers: argument 'layers': expected a layer count in "
                f"[0, {layers}], got {count}") in str(error.value)  # fmt: skip
    stack = model._decoder_stacks[""]
    assert len(stack) == layers
    cos, sin = model._rope_table(step.positions, flat=True)
    view = step.kv_cache.view(0, step.block_tables, step.rows, step.positions)
    with pytest.raises(ValueError) as error:
        stack(x, (cos[:9], sin[:9], step.slots, view), layers)  # rows for positions 0..8
    assert ("cpu_decoder_layers: argument 'positions': expected positions in [0, 9) (the "
            "rotary tables' rows), got 9 at token 0") in str(error.value)  # fmt: skip


def test_a_stack_returns_the_rows_asked_for_with_their_bits_and_names_a_bad_row():
    """``output_rows``: the last layer finishes those tokens alone, in the order asked, with
    the bits of the whole result's rows (its products over 3 rows, not 5, take other
    tiles), and every token's K/V written as without; a row out of range is named."""
    model = LlamaForCausalLM(CONFIGS["biases-odd"])
    layers = model.config.num_layers
    x, step = decode_step(model, tokens=5)
    whole = model._fused_layers(x, step, layers).numpy()
    caches = (step.kv_cache.key.numpy(), step.kv_cache.value.numpy())
    rows = [3, 0, 4]
    x, step = decode_step(model, tokens=5)
    part = model._fused_layers(x, step, layers, paddle.to_tensor(rows, dtype="int64"))
    np.testing.assert_array_equal(part.numpy().view(np.uint32), whole[rows].view(np.uint32))
    for cache, expected in zip((step.kv_cache.key, step.kv_cache.value), caches):
        np.testing.assert_array_equal(cache.numpy().view(np.uint32), expected.view(np.uint32))
    untouched = model._fused_layers(x, step, 0, paddle.to_tensor([4], dtype="int64"))
    np.testing.assert_array_equal(untouched.numpy(), x.numpy()[[4]])
    for bad, message in (
        ([5], "expected tokens in [0, 5), got 5 at 0"),
        ([1, -1], "expected tokens in [0, 5), got -1 at 1"),
        ([], "expected at least one token (None: every token), got none"),
    ):
        with pytest.raises(ValueError) as error:
            model._fused_layers(x, step, layers, paddle.to_tensor(bad, dtype="int64"))
        assert f"cpu_decoder_layers: argument 'output_rows': {message}" in str(error.value)
    with pytest.raises(ValueError) as error:
        model._fused_layers(x, step, layers, paddle.to_tensor([0], dtype="int32"))
    assert "cpu_decoder_layers: argument 'output_rows'" in str(error.value)


@pytest.mark.parametrize("fused", [True, False])
def test_steps_finish_only_the_rows_their_logits_read(fused, monkeypatch):
    """A step's last layer finishes only the tokens whose logits it computes (each prompt's
    last): the logits and caches of ``fused_steps`` are those of every token finished, bit
    for bit where the layers fuse (the op's rows do not depend on their batch)."""
    model = LlamaForCausalLM(CONFIGS["llama-gqa"])
    finished = []
    run_layers = LlamaForCausalLM._run_layers

    def counted(self, input_ids, positions, attend, fused=None, layers=None, output_rows=None):
        rows = input_ids.shape[0] if output_rows is None else output_rows.shape[0]
        finished.append((input_ids.shape[0], rows))
        return run_layers(self, input_ids, positions, attend, fused, layers, output_rows)

    monkeypatch.setattr(LlamaForCausalLM, "_run_layers", counted)
    read = fused_steps(model, fused, monkeypatch)
    # Tokens per step: 9 + 17 + 4, then 1 + 3 + 6, then 3 decode tokens (every one read).
    assert finished == [(30, 3), (10, 3), (3, 3)]

    class EveryRow(llama.RowsRead):
        def __init__(self, tokens, last_token_index, extra_index=None):
            self.output_rows = None
            self.last_token_index, self.extra_index = last_token_index, extra_index
            self.last_rows = last_token_index.numpy().tolist()

    monkeypatch.setattr(llama, "RowsRead", EveryRow)
    every = fused_steps(model, fused, monkeypatch)
    for mine, expected in zip(read, every):
        if fused:
            np.testing.assert_array_equal(mine.view(np.uint32), expected.view(np.uint32))
        else:
            np.testing.assert_allclose(mine, expected, rtol=1e-5, atol=1e-6)

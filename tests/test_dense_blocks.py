"""The model's dense blocks: compiled (oneDNN) and eager give the same numbers up to float32
rounding, the dispatch picks the path by rows, the flag is left as found, nothing is
printed, and the switch works."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

import paddle_step.layers.dense_blocks as dense_blocks
from paddle_step.config import ModelConfig
from paddle_step.layers.dense_blocks import model_blocks, onednn_available
from paddle_step.layers.paged_attention import PagedKVCache, build_flat_batch
from paddle_step.models.llama import LlamaForCausalLM

needs_onednn = pytest.mark.skipif(
    not onednn_available("float32"),
    reason="compiled blocks need Paddle 3 with oneDNN on the CPU",
)

# Odd sizes, a bias on q/k/v and o, tied embeddings: every optional argument of the blocks.
BIASED_TIED = ModelConfig(
    vocab_size=1000,
    hidden_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    intermediate_size=136,
    qkv_bias=True,
    o_proj_bias=True,
    tie_word_embeddings=True,
    seed=3,
)
PLAIN = ModelConfig(vocab_size=777, hidden_size=64, num_layers=2, seed=4)
ISSUE_SHAPE = ModelConfig(
    vocab_size=32000,
    hidden_size=512,
    num_layers=1,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1536,
)


def block_arguments(model: LlamaForCausalLM, rows: int, rng: np.random.Generator) -> dict:
    """Arguments of each block of ``model``'s first layer for ``rows`` tokens."""
    cfg, layer = model.config, model.layers[0]
    w_qkv, qkv_bias, w_gate_up = layer._fused_weights()

    def tensor(*shape: int) -> paddle.Tensor:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32"))

    angles = rng.uniform(0, 6.3, (rows, 1, cfg.head_dim)).astype("float32")
    biases = [] if qkv_bias is None else [qkv_bias]
    head = model.embed if model.lm_head is None else model.lm_head
    return {
        "attention_inputs": [
            tensor(rows, cfg.hidden_size),
            layer.attn_norm.weight,
            w_qkv,
            paddle.to_tensor(np.cos(angles)),
            paddle.to_tensor(np.sin(angles)),
            *biases,
        ],
        "output_and_mlp": [
            tensor(rows, cfg.hidden_size),
            tensor(rows, cfg.num_heads * cfg.head_dim),
            layer.wo,
            layer.mlp_norm.weight,
            w_gate_up,
            layer.w_down,
            *([] if layer.o_bias is None else [layer.o_bias]),
        ],
        "logits": [tensor(rows, cfg.hidden_size), model.final_norm.weight, head],
    }


def as_list(outputs) -> list[np.ndarray]:
    return [o.numpy() for o in (outputs if isinstance(outputs, tuple) else (outputs,))]


@needs_onednn
@pytest.mark.parametrize("config", [BIASED_TIED, PLAIN], ids=["biased-tied", "plain"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 83])
def test_compiled_blocks_match_eager(config: ModelConfig, rows: int) -> None:
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(rows)
    with paddle.no_grad():
        for name, args in block_arguments(model, rows, rng).items():
            block = getattr(model.blocks, name)
            block.min_rows = 1  # compiled whatever the rows
            compiled = as_list(block(*args))
            eager = as_list(block.function(*args))
            assert [c.shape for c in compiled] == [e.shape for e in eager], name
            for c, e in zip(compiled, eager):
                np.testing.assert_allclose(c, e, rtol=2e-5, atol=2e-5, err_msg=name)


class Spy:
    """Stands in for a block's function or compiled program; records its calls."""

    def __init__(self, label: str, calls: list[str]) -> None:
        self.label, self.calls = label, calls

    def __call__(self, *args):
        self.calls.append(self.label)
        return self.label


@needs_onednn
@pytest.mark.parametrize(
    "config", [BIASED_TIED, PLAIN, ISSUE_SHAPE], ids=["biased-tied", "plain", "issue"]
)
def test_work_size_picks_the_path(config: ModelConfig) -> None:
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    macs_per_row = {
        "attention_inputs": config.hidden_size * (q_width + 2 * kv_width),
        "output_and_mlp": config.hidden_size * (q_width + 3 * config.intermediate_size),
        "logits": config.hidden_size * config.vocab_size,
    }
    blocks = model_blocks(config)
    for name, per_row in macs_per_row.items():
        block = getattr(blocks, name)
        calls: list[str] = []
        block.function, block.compiled = Spy("eager", calls), Spy("compiled", calls)
        min_rows = max(2, math.ceil(dense_blocks.MIN_COMPILED_MACS / per_row))
        assert block.min_rows == min_rows, name
        for rows in (1, min_rows - 1, min_rows, min_rows + 50):
            block(paddle.zeros([rows, 4]))
        assert calls == ["eager", "eager", "compiled", "compiled"], name
    if config is ISSUE_SHAPE:  # the thresholds measured on this shape
        assert [getattr(blocks, name).min_rows for name in macs_per_row] == [23, 5, 2]


def test_padded_rows_bound_the_shapes() -> None:
    counts = range(1, 16385)
    padded = [dense_blocks.padded_rows(rows) for rows in counts]
    assert all(p == r for r, p in zip(counts, padded) if r <= dense_blocks.EXACT_ROWS)
    assert all(r <= p <= r * 1.125 for r, p in zip(counts, padded))
    assert padded == sorted(padded)
    assert len(set(padded)) == 96


@needs_onednn
def test_compiled_call_pads_and_returns_the_real_rows() -> None:
    """The program sees padded per-row arguments (zeros appended), the other arguments as
    they are, and the caller gets back exactly its rows."""
    blocks = model_blocks(PLAIN)
    seen: list[list[list[int]]] = []

    def program(*args):
        seen.append([list(arg.shape) for arg in args])
        return args[0] * 2, args[3] + 1, args[4]  # outputs with the padded row count

    block = blocks.attention_inputs
    block.min_rows, block.compiled = 2, program
    x = paddle.arange(83 * 64, dtype="float32").reshape([83, 64]) + 1
    angles = paddle.ones([83, 1, 16])
    weights = [paddle.ones([64]), paddle.ones([64, 128])]
    doubled, cos_plus_one, sin = block(x, *weights, angles, angles)
    assert seen == [[[88, 64], [64], [64, 128], [88, 1, 16], [88, 1, 16]]]
    np.testing.assert_array_equal(doubled.numpy(), 2 * x.numpy())
    np.testing.assert_array_equal(cos_plus_one.numpy(), 2 * np.ones([83, 1, 16]))
    assert sin.shape == [83, 1, 16]

    logits = blocks.logits
    logits.min_rows, logits.compiled = 2, lambda hidden, norm, head: hidden[:, :1] - 1
    out = logits(x, *weights)
    np.testing.assert_array_equal(out.numpy(), x.numpy()[:, :1] - 1)
    exact = logits(x[:16], *weights)
    assert exact.shape == [16, 1]


def test_tensor_parallel_mlp_stays_eager() -> None:
    """The all-reduce runs between the block's products: it cannot be one program."""
    blocks = model_blocks(PLAIN, all_reduce=lambda x: x)
    assert blocks.output_and_mlp.compiled is None


def test_float64_and_the_switch_stay_eager(monkeypatch) -> None:
    assert not onednn_available("float64")
    assert model_blocks(ModelConfig(dtype="float64")).logits.compiled is None
    monkeypatch.setenv("PADDLE_STEP_ONEDNN", "0")
    assert not onednn_available("float32")
    assert all(block.compiled is None for block in model_blocks(PLAIN))


def test_switch_rejects_other_values(monkeypatch) -> None:
    monkeypatch.setenv("PADDLE_STEP_ONEDNN", "yes")
    with pytest.raises(ValueError, match=r"PADDLE_STEP_ONEDNN must be '0' or '1', got 'yes'"):
        onednn_available("float32")


@needs_onednn
@pytest.mark.parametrize("user_setting", [False, True])
def test_flag_is_left_as_found(user_setting: bool) -> None:
    model = LlamaForCausalLM(PLAIN)
    args = block_arguments(model, 8, np.random.default_rng(0))["logits"]
    paddle.set_flags({"FLAGS_use_mkldnn": user_setting})
    try:
        with paddle.no_grad():
            model.blocks.logits(*args)
        assert paddle.get_flags(["FLAGS_use_mkldnn"])["FLAGS_use_mkldnn"] is user_setting
    finally:
        paddle.set_flags({"FLAGS_use_mkldnn": False})


@needs_onednn
def test_compiling_prints_nothing(capfd) -> None:
    """A compiled ``paddle.mean`` prints on stdout (Paddle 3.3), which would corrupt
    ``generate.py --json``: the blocks must not contain one."""
    model = LlamaForCausalLM(BIASED_TIED)  # new programs: traced and compiled in this test
    with paddle.no_grad():
        for name, args in block_arguments(model, 90, np.random.default_rng(1)).items():
            getattr(model.blocks, name)(*args)
    assert capfd.readouterr().out == ""


@needs_onednn
def test_paged_step_with_compiled_blocks_matches_eager(monkeypatch) -> None:
    """With the threshold lowered so that this small model compiles every block of two
    rows or more (the 40-token prefill row, the 8 rows' logits), a mixed step gives the
    same logits as the same model with the switch off, up to float32 rounding, and the
    same greedy tokens."""
    config = ModelConfig(vocab_size=500, hidden_size=64, num_layers=2, seed=9)
    monkeypatch.setattr(dense_blocks, "MIN_COMPILED_MACS", 1)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, size=n).tolist() for n in (40, 3, 9, 1, 17, 2, 5, 8)]
    width, block_size = 48, 8
    input_ids = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = prompt
    tables = np.arange(len(prompts) * 6, dtype=np.int32).reshape(len(prompts), 6)

    def step_logits(model: LlamaForCausalLM) -> np.ndarray:
        cache = PagedKVCache.for_config(config, num_blocks=tables.size, block_size=block_size)
        batch = build_flat_batch(
            paddle.to_tensor(input_ids),
            paddle.to_tensor(np.array([len(p) for p in prompts], dtype=np.int32)),
            paddle.zeros([len(prompts)], dtype="int32"),
            paddle.to_tensor(tables),
            block_size,
        )
        return model.forward_paged(**batch, kv_cache=cache).numpy()

    compiled_model = LlamaForCausalLM(config)
    assert [block.min_rows for block in compiled_model.blocks] == [2, 2, 2]
    compiled = step_logits(compiled_model)
    monkeypatch.setenv("PADDLE_STEP_ONEDNN", "0")
    eager_model = LlamaForCausalLM(config)
    assert eager_model.blocks.logits.compiled is None
    eager = step_logits(eager_model)
    np.testing.assert_allclose(compiled, eager, rtol=1e-4, atol=1e-4)
    assert (compiled.argmax(-1) == eager.argmax(-1)).all()

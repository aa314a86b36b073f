"""The model's dense blocks: every way they run (eager, the CPU op, compiled onto oneDNN)
gives the same numbers up to float32 rounding; the first call of a row count class times
the ways and keeps the fastest; the environment can force one; the flag is left as found;
nothing is printed."""

from __future__ import annotations

import time

import numpy as np
import paddle
import pytest

import paddle_step.layers.dense_blocks as dense_blocks
from paddle_step.config import ModelConfig
from paddle_step.layers import cpu_linear
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


def block_arguments(model: LlamaForCausalLM, rows: int, rng: np.random.Generator) -> dict:
    """Arguments of each block of ``model``'s first layer for ``rows`` tokens."""
    cfg, layer = model.config, model.layers[0]
    w_qkv, qkv_bias, w_o, w_gate_up, w_down = layer._dense_weights()

    def tensor(*shape: int) -> paddle.Tensor:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32"))

    angles = rng.uniform(0, 6.3, (rows, 1, cfg.head_dim)).astype("float32")
    biases = [] if qkv_bias is None else [qkv_bias]
    model._logits(tensor(1, cfg.hidden_size))  # makes the LM head's DenseWeight
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
            w_o,
            layer.mlp_norm.weight,
            w_gate_up,
            w_down,
            *([] if layer.o_bias is None else [layer.o_bias]),
        ],
        "logits": [tensor(rows, cfg.hidden_size), model.final_norm.weight, model._lm_head],
    }


def as_list(outputs) -> list[np.ndarray]:
    return [o.numpy() for o in (outputs if isinstance(outputs, tuple) else (outputs,))]


@pytest.mark.parametrize("config", [BIASED_TIED, PLAIN], ids=["biased-tied", "plain"])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 83])
def test_every_way_matches_eager(config: ModelConfig, rows: int) -> None:
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(rows)
    with paddle.no_grad():
        for name, args in block_arguments(model, rows, rng).items():
            block = getattr(model.blocks, name)
            assert block.methods[:2] == ("eager", "op"), name
            eager = as_list(block.run("eager", *args))
            for method in block.methods[1:]:
                other = as_list(block.run(method, *args))
                assert [o.shape for o in other] == [e.shape for e in eager], (name, method)
                for o, e in zip(other, eager):
                    np.testing.assert_allclose(o, e, rtol=2e-5, atol=2e-5, err_msg=name + method)


class Timed:
    """Stands in for one way of a block: takes ``seconds`` a call and records its calls."""

    def __init__(self, label: str, seconds: float, calls: list[str]) -> None:
        self.label, self.seconds, self.calls = label, seconds, calls

    def __call__(self, *args):
        self.calls.append(self.label)
        time.sleep(self.seconds)
        return paddle.full([args[0].shape[0], 1], float(len(self.label)))


def with_timed_ways(block, seconds: dict[str, float]) -> list[str]:
    calls: list[str] = []
    block._functions = {m: Timed(m, s, calls) for m, s in seconds.items()}
    return calls


def test_first_call_of_a_row_class_times_every_way_and_keeps_the_fastest() -> None:
    block = model_blocks(PLAIN).logits
    # Gaps of 30 ms: far above the scheduling noise of a loaded machine.
    calls = with_timed_ways(block, {"eager": 0.06, "op": 0.0, "compiled": 0.03})
    weights = [dense_blocks.DenseWeight(paddle.ones([1]), None)]
    out = block(paddle.zeros([17, 4]), paddle.ones([4]), *weights)  # class 18
    per_way = 1 + dense_blocks.TIMED_CALLS
    # A warm-up call of each, then rounds that call every way in turn.
    assert calls == ["eager", "op", "compiled"] * per_way
    assert block.choice == {18: "op"} and set(block.timings[18]) == {"eager", "op", "compiled"}
    np.testing.assert_array_equal(out.numpy(), np.full([17, 1], 2.0))  # the op's outputs
    calls.clear()
    block(paddle.zeros([18, 4]), paddle.ones([4]), *weights)  # same class: no timing
    assert calls == ["op"]
    calls.clear()
    block._functions["compiled"].seconds = 0.0
    block._functions["op"].seconds = 0.06
    block(paddle.zeros([3, 4]), paddle.ones([4]), *weights)  # a new class is timed anew
    assert block.choice[3] == "compiled" and len(calls) == 3 * per_way


def test_one_slow_call_does_not_decide_the_way() -> None:
    # A burst of another job slows the op's first timed call: its other calls still
    # show it the faster.
    block = model_blocks(PLAIN).logits
    calls = with_timed_ways(block, {"eager": 0.03, "op": 0.0})
    op = block._functions["op"]
    delays = iter([0.0, 0.08])  # the warm-up, then the first timed call

    def bursty(*args):
        op.seconds = next(delays, 0.0)
        return Timed.__call__(op, *args)

    block._functions["op"] = bursty
    block(paddle.zeros([5, 4]), paddle.ones([4]), dense_blocks.DenseWeight(paddle.ones([1]), None))
    assert block.choice == {5: "op"}
    assert len(calls) == 2 * (1 + dense_blocks.TIMED_CALLS)


def test_ranks_agree_on_the_way() -> None:
    """Timings are summed over the tensor-parallel ranks (``agree``): every rank keeps the
    way that is fastest in total, not its own."""
    block = model_blocks(PLAIN).logits
    with_timed_ways(block, {"eager": 0.03, "op": 0.0})
    # The other rank found the op much slower.
    block.agree = lambda t: t + paddle.to_tensor([0.0, 1.0], dtype="float64")
    block(paddle.zeros([5, 4]), paddle.ones([4]), dense_blocks.DenseWeight(paddle.ones([1]), None))
    assert block.choice == {5: "eager"}


@pytest.mark.parametrize("method", ["eager", "op", "compiled"])
def test_environment_forces_a_way(monkeypatch, method: str) -> None:
    monkeypatch.setenv("PADDLE_STEP_DENSE", method)
    block = model_blocks(PLAIN).logits
    if method not in block.methods:
        pytest.skip(f"{method} cannot run here")
    assert block.forced == method
    calls = with_timed_ways(block, {m: 0.0 for m in block.methods})
    block(paddle.zeros([5, 4]), paddle.ones([4]), dense_blocks.DenseWeight(paddle.ones([1]), None))
    assert calls == [method] and block.choice == {}


def test_environment_rejects_other_ways(monkeypatch) -> None:
    monkeypatch.setenv("PADDLE_STEP_DENSE", "fast")
    with pytest.raises(ValueError, match=r"PADDLE_STEP_DENSE must be 'auto' or one of .*'fast'"):
        model_blocks(PLAIN)


def test_choices_are_logged(caplog) -> None:
    import logging

    block = model_blocks(PLAIN).logits
    with_timed_ways(block, {"eager": 0.05, "op": 0.0})
    with caplog.at_level(logging.DEBUG, logger="paddle_step.layers.dense_blocks"):
        block(paddle.zeros([9, 4]), paddle.ones([4]), dense_blocks.DenseWeight(None, None))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["logits, 9 rows"]
    assert caplog.records[0].getMessage().endswith("-> op")


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
    block._functions["compiled"] = program
    x = paddle.arange(83 * 64, dtype="float32").reshape([83, 64]) + 1
    angles = paddle.ones([83, 1, 16])
    weights = [paddle.ones([64]), dense_blocks.DenseWeight(paddle.ones([64, 128]), None)]
    doubled, cos_plus_one, sin = block.run("compiled", x, *weights, angles, angles)
    assert seen == [[[88, 64], [64], [64, 128], [88, 1, 16], [88, 1, 16]]]
    np.testing.assert_array_equal(doubled.numpy(), 2 * x.numpy())
    np.testing.assert_array_equal(cos_plus_one.numpy(), 2 * np.ones([83, 1, 16]))
    assert sin.shape == [83, 1, 16]

    logits = blocks.logits
    logits._functions["compiled"] = lambda hidden, norm, head: hidden[:, :1] - 1
    out = logits.run("compiled", x, *weights)
    np.testing.assert_array_equal(out.numpy(), x.numpy()[:, :1] - 1)
    exact = logits.run("compiled", x[:16], *weights)
    assert exact.shape == [16, 1]


def test_tensor_parallel_mlp_stays_eager() -> None:
    """The all-reduce runs between the block's products: it cannot be one program."""
    blocks = model_blocks(PLAIN, all_reduce=lambda x: x)
    assert "compiled" not in blocks.output_and_mlp.methods
    assert blocks.output_and_mlp.agree is not None


def test_float64_stays_eager_and_the_switch_leaves_compiled_out(monkeypatch) -> None:
    assert not onednn_available("float64")
    assert all(block.methods == ("eager",) for block in model_blocks(ModelConfig(dtype="float64")))
    monkeypatch.setenv("PADDLE_STEP_ONEDNN", "0")
    assert not onednn_available("float32")
    assert all(block.methods == ("eager", "op") for block in model_blocks(PLAIN))


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8"])
def test_packed_weights_run_one_way_for_every_row_count(weight_format, monkeypatch) -> None:
    """``op`` alone, on every path (on avx512_bf16: dot products on x in bfloat16 or 8
    bits), never timed against ``op_widened``: the two round x differently, so a timed
    choice per row count made a token's greedy result depend on its batch and flip between
    runs. ``PADDLE_STEP_DENSE=op_widened`` gives the widened way alone where both exist."""
    from paddle_step.testing.cpu_paths import on_isa, runs_here

    config = ModelConfig(vocab_size=300, hidden_size=64, num_layers=1, weight_format=weight_format)
    for path in filter(runs_here, ("avx2", "avx512", "avx512_bf16")):
        with on_isa(path):
            assert all(block.methods == ("op",) for block in model_blocks(config)), path
            monkeypatch.setenv("PADDLE_STEP_DENSE", "op_widened")
            expected = ("op_widened",) if path == "avx512_bf16" else ("op",)
            assert all(block.methods == expected for block in model_blocks(config)), path
            monkeypatch.delenv("PADDLE_STEP_DENSE")


def test_switch_rejects_other_values(monkeypatch) -> None:
    monkeypatch.setenv("PADDLE_STEP_ONEDNN", "yes")
    with pytest.raises(ValueError, match=r"PADDLE_STEP_ONEDNN must be '0' or '1', got 'yes'"):
        onednn_available("float32")


@needs_onednn
@pytest.mark.parametrize("user_setting", [False, True])
def test_flag_is_left_as_found(user_setting: bool) -> None:
    model = LlamaForCausalLM(PLAIN)
    args = block_arguments(model, 8, np.random.default_rng(0))["logits"]
    saved = paddle.get_flags(["FLAGS_use_mkldnn"])["FLAGS_use_mkldnn"]
    paddle.set_flags({"FLAGS_use_mkldnn": user_setting})
    try:
        with paddle.no_grad():
            model.blocks.logits.run("compiled", *args)
        assert paddle.get_flags(["FLAGS_use_mkldnn"])["FLAGS_use_mkldnn"] is user_setting
    finally:
        paddle.set_flags({"FLAGS_use_mkldnn": saved})


@needs_onednn
def test_compiling_prints_nothing(capfd) -> None:
    """A compiled ``paddle.mean`` prints on stdout (Paddle 3.3), which would corrupt
    ``generate.py --json``: the blocks must not contain one."""
    model = LlamaForCausalLM(BIASED_TIED)  # new programs: traced and compiled in this test
    with paddle.no_grad():
        for name, args in block_arguments(model, 90, np.random.default_rng(1)).items():
            getattr(model.blocks, name).run("compiled", *args)
    assert capfd.readouterr().out == ""


@pytest.mark.parametrize("method", ["op", "compiled"])
def test_paged_step_matches_eager(monkeypatch, method: str) -> None:
    """A mixed step (a 40-token prefill row among decode rows) with every block forced
    ``method``'s way gives the same logits as the eager model up to float32 rounding, and
    the same greedy tokens."""
    if method == "compiled" and not onednn_available("float32"):
        pytest.skip("compiled blocks need Paddle 3 with oneDNN on the CPU")
    config = ModelConfig(vocab_size=500, hidden_size=64, num_layers=2, seed=9)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, size=n).tolist() for n in (40, 3, 9, 1, 17, 2, 5, 8)]
    width, block_size = 48, 8
    input_ids = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = prompt
    tables = np.arange(len(prompts) * 6, dtype=np.int32).reshape(len(prompts), 6)

    def step_logits(forced: str) -> np.ndarray:
        monkeypatch.setenv("PADDLE_STEP_DENSE", forced)
        model = LlamaForCausalLM(config)
        assert all(block.forced == forced for block in model.blocks)
        cache = PagedKVCache.for_config(config, num_blocks=tables.size, block_size=block_size)
        batch = build_flat_batch(
            paddle.to_tensor(input_ids),
            paddle.to_tensor(np.array([len(p) for p in prompts], dtype=np.int32)),
            paddle.zeros([len(prompts)], dtype="int32"),
            paddle.to_tensor(tables),
            block_size,
        )
        return model.forward_paged(**batch, kv_cache=cache).numpy()

    other, eager = step_logits(method), step_logits("eager")
    np.testing.assert_allclose(other, eager, rtol=1e-4, atol=1e-4)
    assert (other.argmax(-1) == eager.argmax(-1)).all()


@pytest.mark.parametrize("explain", [True, False])
def test_explain_dense_prints_the_choices(explain: bool) -> None:
    """``--explain-dense``: a line on stderr per block and row count class, naming the
    timings and the way kept (and one per class where whole layers were timed against the
    blocks); stdout (``--json``) stays clean. Without it, none of them (``import
    paddle.distributed`` gives the root logger an INFO handler), nor paddle's own INFO."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
    command = [sys.executable, str(script), "--model", "random", "--num-requests", "2"]
    command += ["--max-new-tokens", "3", "--json", *(["--explain-dense"] if explain else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    json.loads(done.stdout)
    if not explain:
        assert " rows: " not in done.stderr and "prefetch distance" not in done.stderr
        assert "New Executor" not in done.stderr  # paddle's glog INFO, quiet by default
        return
    lines = [line for line in done.stderr.splitlines() if line.startswith("dense: ")]
    names = {line.split(",")[0].removeprefix("dense: ") for line in lines}
    assert {"attention_inputs", "output_and_mlp", "logits"} <= names
    assert names <= {"attention_inputs", "output_and_mlp", "logits", "layers"}
    assert all(" ms" in line and " -> " in line for line in lines)


@pytest.mark.parametrize("rows, width", [(1, 1), (1, 512), (5, 7), (33, 131), (2, 896)])
def test_op_rms_norm_is_rms_norm_in_float32(rows: int, width: int) -> None:
    rng = np.random.default_rng(rows * 1000 + width)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    weight = rng.standard_normal(width).astype(np.float32)
    out = dense_blocks.op_rms_norm(paddle.to_tensor(x), paddle.to_tensor(weight), 1e-5).numpy()
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + 1e-5) * weight
    assert out.shape == (rows, width) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    int(paddle.__version__.split(".")[0]) < 3,
    reason=f"paddle {paddle.__version__} hands a custom op's empty output back as None",
)
def test_op_rms_norm_of_no_rows_is_empty() -> None:
    # A tensor of no rows may carry any strides (paddle.to_tensor gives [0, 8]).
    x = paddle.to_tensor(np.zeros((0, 8), np.float32))
    out = dense_blocks.op_rms_norm(x, paddle.ones([8]), 1e-5)
    assert out.shape == [0, 8] and out.dtype == paddle.float32


@pytest.mark.parametrize(
    "x, weight, message",
    [
        (paddle.ones([2, 4], "float64"), paddle.ones([4]), "'x': expected dtype float32"),
        (paddle.ones([8]), paddle.ones([8]), r"'x': expected shape \[-1, -1\], got shape \[8\]"),
        (paddle.ones([2, 4]), paddle.ones([5]), r"'weight': expected shape \[4\], got shape \[5\]"),
    ],
)
def test_op_rms_norm_names_a_bad_argument(x, weight, message: str) -> None:
    with pytest.raises(ValueError, match="cpu_rms_norm: argument " + message):
        dense_blocks.op_rms_norm(x, weight, 1e-6)


@pytest.mark.parametrize("config", [BIASED_TIED, PLAIN], ids=["biased-tied", "plain"])
def test_logits_take_the_norm_of_their_way(config: ModelConfig) -> None:
    # The op's ways normalize with the op, eager and compiled with the eager expression.
    model = LlamaForCausalLM(config)
    hidden, weight, head = block_arguments(model, 3, np.random.default_rng(8))["logits"]
    eps, block = config.rms_eps, model.blocks.logits
    with paddle.no_grad():
        op_normed = dense_blocks.op_rms_norm(hidden, weight, eps)
        eager_normed = dense_blocks.rms_norm(hidden, weight, eps)
        assert not np.array_equal(op_normed.numpy(), eager_normed.numpy())  # they round apart
        tied = config.tie_word_embeddings
        expected = {
            "op": cpu_linear.linear(op_normed, head.packed),
            "eager": paddle.matmul(eager_normed, head.tensor, transpose_y=tied),
        }
        for way, logits in expected.items():
            got = block.run(way, hidden, weight, head)
            np.testing.assert_array_equal(got.numpy(), logits.numpy())

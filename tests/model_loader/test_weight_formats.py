"""bfloat16 and int8 weights (``load_checkpoint``'s ``dtype`` and ``quantization``): what
``auto`` picks, that no float32 copy is kept, that the model computes the float64 model of
the very weights it holds, its accuracy against float32 and transformers, and the refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.errors import CheckpointError
from paddle_step.layers import cpu_linear
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.perplexity import log_softmax, perplexity
from paddle_step.testing.weight_formats import (
    bfloat16_bits,
    bfloat16_values,
    int8_values,
    write_bfloat16_copy,
)

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data" / "hf-tiny"
SHIPPED = TESTS.parent / "python" / "paddle_step" / "assets" / "pydoc-tiny"
HELD_OUT = TESTS / "data" / "heldout" / "python_notes.txt"
GOLDEN = json.loads((DATA / "golden.json").read_text())
MODELS = ("llama-tiny", "qwen2-tiny")
# (dtype, quantization) of each packed format.
FORMATS = {"bfloat16": ("bfloat16", None), "int8": ("float32", "int8")}
PRODUCTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


# The ways the dense blocks may run packed weights (dense_blocks.py): x rounded to bfloat16
# or quantized to 8 bits times the weights (vdpbf16ps, vpdpbusd: where the CPU has
# AVX512-BF16 and VNNI), or the weights widened to float32. Each is forced in turn where a
# test needs one of them for sure.
WAYS = ("op", "op_widened")


def load(path: Path, weight_format: str):
    dtype, quantization = FORMATS[weight_format]
    return load_checkpoint(path, dtype, quantization)


def golden_prompts(name: str) -> list[dict]:
    return [e for e in GOLDEN["models"][name]["prompts"] if e["dtype"] == "float64"]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    return write_bfloat16_copy(DATA / "qwen2-tiny", tmp_path_factory.mktemp("bf16") / "qwen2")


def test_auto_is_the_checkpoints_dtype(bf16_checkpoint) -> None:
    # float16 on disk (the shipped model) and float32 compute in float32, bfloat16 stays.
    for path, expected in (
        (SHIPPED, None),
        (DATA / "llama-tiny", None),
        (bf16_checkpoint, "bfloat16"),
    ):
        config = load_checkpoint(path).model.config
        assert (config.dtype, config.weight_format) == ("float32", expected), path
    config = load_checkpoint(bf16_checkpoint, quantization="int8").model.config
    assert (config.dtype, config.weight_format) == ("float32", "int8")


def test_bfloat16_checkpoint_stays_bfloat16_bit_for_bit(bf16_checkpoint) -> None:
    model = load_checkpoint(bf16_checkpoint).model
    config = model.config
    # Only norms and biases remain parameters: no float32 copy of a product's weights.
    parameters = dict(model.named_parameters())
    assert all(name.endswith(("norm.weight", "_bias")) for name in parameters), sorted(parameters)
    assert model.embed is None and model.lm_head is None
    assert model._lm_head is model._embedding  # tied: one copy for the lookup and the head
    packed = model._embedding.packed
    assert (packed.format, packed.weights.dtype) == ("bfloat16", paddle.bfloat16)
    # The embedding read back from the panels is the checkpoint's bfloat16 values exactly.
    full = load_checkpoint(bf16_checkpoint, dtype="float32").model
    every_id = paddle.arange(config.vocab_size, dtype="int64")
    np.testing.assert_array_equal(cpu_linear.columns(packed, every_id).numpy(), full.embed.numpy())


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "mixed"])
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_checkpoint_packs_its_bits_as_the_widened_values_would(
    name, weight_format, mixed, tmp_path
) -> None:
    """A bfloat16 checkpoint's matrices are packed (or quantized) from its bits, in the
    file's [out, in] order (no float32 copy): every product's panels equal those packed from
    the float32 model of the same file, fused q/k/v and gate/up included; norms and biases
    widened. A checkpoint that stores one matrix in float32 takes the float path, with the
    same panels."""
    float32 = {"model.layers.0.self_attn.k_proj.weight"} if mixed else set()
    path = write_bfloat16_copy(DATA / name, tmp_path / name, keep_float32=float32)
    model = load(path, weight_format).model
    full = load_checkpoint(path, dtype="float32").model
    assert model.config.weight_format == weight_format

    def same_panels(packed: cpu_linear.PackedWeights, *parts: paddle.Tensor) -> None:
        expected = cpu_linear.pack(
            paddle.concat(parts, axis=1), weight_format, packed.group_size or None
        )
        assert (packed.k, packed.n) == (expected.k, expected.n)
        bits = "uint16" if weight_format == "bfloat16" else "int8"
        np.testing.assert_array_equal(
            packed.weights.view(bits).numpy(), expected.weights.view(bits).numpy()
        )
        if expected.scales is not None:
            np.testing.assert_array_equal(packed.scales.numpy(), expected.scales.numpy())

    for layer, full_layer in zip(model.layers, full.layers):
        qkv, qkv_bias, o, gate_up, down = (each for each in layer._dense_weights())
        same_panels(qkv.packed, full_layer.wq, full_layer.wk, full_layer.wv)
        same_panels(o.packed, full_layer.wo)
        same_panels(gate_up.packed, full_layer.w_gate, full_layer.w_up)
        same_panels(down.packed, full_layer.w_down)
        for ours, theirs in ((layer.attn_norm, full_layer.attn_norm),
                             (layer.mlp_norm, full_layer.mlp_norm)):  # fmt: skip
            np.testing.assert_array_equal(ours.weight.numpy(), theirs.weight.numpy())
        if full_layer.q_bias is not None:
            biases = (full_layer.q_bias, full_layer.k_bias, full_layer.v_bias)
            np.testing.assert_array_equal(qkv_bias.numpy(), paddle.concat(biases).numpy())
    head = full.embed.T if full.config.tie_word_embeddings else full.lm_head
    same_panels(model._lm_head.packed, head)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("weight_format", FORMATS)
def test_model_computes_the_float64_model_of_its_weights(monkeypatch, name, weight_format) -> None:
    """Against a float64 model holding, as float64, the values the format keeps: bfloat16
    rounding or int8 quantization per output column (the tied embedding per token), in
    NumPy. What remains is float32 rounding (~1e-6 of the logits); a misplaced weight or a
    wrong scale is off by 1e-2 or more. The weights run widened here: the way that rounds x
    to bfloat16 or 8 bits too is checked product by product (tests/layers/test_cpu_linear.py)
    and by the accuracy tests below."""
    monkeypatch.setenv("PADDLE_STEP_DENSE", "op_widened")
    model = load(DATA / name, weight_format).model
    float64 = load_checkpoint(DATA / name, dtype="float64").model
    weights = {key: param.numpy() for key, param in float64.named_parameters()}
    for key, array in weights.items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf in PRODUCTS or leaf == "embed":
            # The embedding is packed as the LM head [hidden, vocab]: a column per token.
            oriented = array.T if leaf == "embed" else array
            rounded = (
                bfloat16_values(oriented) if weight_format == "bfloat16" else int8_values(oriented)
            )
            weights[key] = (rounded.T if leaf == "embed" else rounded).astype(np.float64)
    reference = LlamaForCausalLM(float64.config, weights)
    for entry in golden_prompts(name):
        got = model.logits_all_positions(entry["prompt_ids"]).numpy()
        expected = reference.logits_all_positions(entry["prompt_ids"]).numpy()
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max(), entry["prompt"]


@pytest.mark.parametrize(
    "weight_format, way",
    [(weight_format, way) for weight_format in FORMATS for way in ("auto", *WAYS)],
)
def test_engine_matches_naive_decode_under_preemption(monkeypatch, weight_format, way) -> None:
    """One way for every row count (each way's rows do not depend on the others), so the
    engine's steps and the naive full recompute compute the same bits; ``auto`` (as
    shipped) too: packed weights are not timed between ways that round x differently."""
    monkeypatch.setenv("PADDLE_STEP_DENSE", way)
    model = load(DATA / "qwen2-tiny", weight_format).model
    prompts = [e["prompt_ids"] for e in golden_prompts("qwen2-tiny")]
    expected, _ = generate_naive(model, prompts, SamplingParams(max_tokens=40))
    config = EngineConfig(
        max_batch=6, max_model_len=56, block_size=4, num_kv_blocks=70, decoder_pool_ratio=0.2
    )
    engine = Engine(model, config)
    results = engine.generate(prompts, SamplingParams(max_tokens=40))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert engine.stats.preemptions > 0


def test_held_out_perplexity_within_bounds_of_float32(monkeypatch) -> None:
    """The shipped model over a text it was not trained on (written for this test): bfloat16
    within 1% of float32's perplexity, int8 within 2% (each way they run)."""
    text = HELD_OUT.read_text()
    results = {}
    runs = [("float32", "float32", None, "auto")]
    runs += [(f"bfloat16 {way}", "bfloat16", None, way) for way in WAYS]
    runs += [(f"int8 {way}", "float32", "int8", way) for way in WAYS]
    for label, dtype, quantization, way in runs:
        monkeypatch.setenv("PADDLE_STEP_DENSE", way)
        loaded = load_checkpoint(SHIPPED, dtype, quantization)
        ids = loaded.tokenizer.encode(text)
        results[label] = perplexity(loaded.model, ids, loaded.max_model_len)
    print("held-out perplexity:", {k: round(v, 3) for k, v in results.items()})
    for way in WAYS:
        assert abs(results[f"bfloat16 {way}"] / results["float32"] - 1) <= 0.01, results
        assert abs(results[f"int8 {way}"] / results["float32"] - 1) <= 0.02, results


@pytest.mark.parametrize("name", MODELS)
def test_log_probs_against_transformers_per_format(monkeypatch, name) -> None:
    """The largest |log-prob difference| from transformers' logits at every prompt position,
    per format (printed: docs/models.md quotes them). float32 is at rounding level; the
    packed formats carry their weights' rounding, bounded well below a wrong weight's."""
    bounds = {"float32": 1e-4, "bfloat16 op": 0.2, "bfloat16 op_widened": 0.2}
    bounds |= {"int8 op": 0.5, "int8 op_widened": 0.5}
    worst = {}
    for label in bounds:
        weight_format, _, way = label.partition(" ")
        monkeypatch.setenv("PADDLE_STEP_DENSE", way or "auto")
        model = (
            load_checkpoint(DATA / name, dtype="float32")
            if label == "float32"
            else load(DATA / name, weight_format)
        ).model
        worst[label] = 0.0
        for index, entry in enumerate(golden_prompts(name)):
            expected = np.load(DATA / name / f"golden_prefill_logits_{index}.npy")
            got = model.logits_all_positions(entry["prompt_ids"]).numpy().astype(np.float64)
            difference = np.abs(log_softmax(got) - log_softmax(expected)).max()
            worst[label] = max(worst[label], float(difference))
    print(f"{name}: max |log-prob - transformers|:", {k: f"{v:.3g}" for k, v in worst.items()})
    for label, bound in bounds.items():
        assert worst[label] <= bound, (label, worst)


def test_refusals(monkeypatch) -> None:
    path = DATA / "llama-tiny"
    with pytest.raises(
        CheckpointError, match=r"argument 'dtype': expected one of .* got 'float16'"
    ):
        load_checkpoint(path, dtype="float16")
    with pytest.raises(CheckpointError, match=r"argument 'quantization': .* got 'int4'"):
        load_checkpoint(path, quantization="int4")
    with pytest.raises(CheckpointError, match="int8 weights compute in float32.*got 'float64'"):
        load_checkpoint(path, dtype="float64", quantization="int8")
    with pytest.raises(ValueError, match="weight_format 'int8' computes in float32"):
        ModelConfig(dtype="float64", weight_format="int8")

    monkeypatch.setattr(cpu_linear, "best_isa", lambda: "scalar")
    for dtype, quantization, named in (("bfloat16", None, "bfloat16"), ("auto", "int8", "int8")):
        with pytest.raises(CheckpointError, match=f"weights in {named}: .*needs AVX2 and FMA"):
            load_checkpoint(path, dtype, quantization)
    load_checkpoint(path, dtype="float32")  # float32 runs anywhere
    monkeypatch.undo()

    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    with pytest.raises(
        CheckpointError, match="weights in bfloat16: .*no kernel for device 'gpu:0'"
    ):
        load_checkpoint(path, dtype="bfloat16")


def test_bfloat16_bits_only_for_the_matrices_of_a_model_packed_in_bfloat16() -> None:
    model = load_checkpoint(DATA / "llama-tiny", dtype="float32").model
    weights = {key: param.numpy() for key, param in model.named_parameters()}
    for key in ("layers.0.wq", "final_norm.weight"):  # a float32 model's matrix; a norm
        bits = dict(weights, **{key: bfloat16_bits(weights[key])})
        with pytest.raises(ValueError, match=r"expected values of a float dtype, got bfloat16"):
            LlamaForCausalLM(model.config, bits)
    # Packed in bfloat16, one product's parts must agree: joined, bits would read as integers.
    mixed = dict(weights, **{"layers.0.wq": bfloat16_bits(weights["layers.0.wq"])})
    with pytest.raises(ValueError, match=r"all as bfloat16 bits or all as floats, got dtypes"):
        LlamaForCausalLM(replace(model.config, weight_format="bfloat16"), mixed)

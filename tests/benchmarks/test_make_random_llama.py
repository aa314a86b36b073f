"""benchmarks/make_random_llama.py: deterministic random checkpoints our loader reads."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import deserialize

from paddle_step.model_loader.loader import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "make_random_llama", ROOT / "benchmarks" / "make_random_llama.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()


def raw_tensors(path: Path) -> dict:
    """name -> (safetensors dtype, shape, bytes), read without the writer's code."""
    return {
        name: (info["dtype"], tuple(info["shape"]), bytes(info["data"]))
        for name, info in deserialize(path.read_bytes())
    }


def nearest_bfloat16(values: np.ndarray) -> np.ndarray:
    """Reference rounding: of the two bfloat16 neighbours (truncated, next up in magnitude),
    the nearer in float64, ties to the even mantissa."""
    bits = values.astype(np.float32).view(np.uint32)
    low = bits & np.uint32(0xFFFF0000)
    high = low + np.uint32(0x10000)
    exact = values.astype(np.float64)
    d_low = np.abs(low.view(np.float32).astype(np.float64) - exact)
    d_high = np.abs(high.view(np.float32).astype(np.float64) - exact)
    low_is_even = ((low >> np.uint32(16)) & np.uint32(1)) == 0
    take_low = (d_low < d_high) | ((d_low == d_high) & low_is_even)
    return np.where(take_low, low, high).view(np.float32)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = SCRIPT.write_checkpoint(str(tmp_path / "a"), seed=3)
    b = SCRIPT.write_checkpoint(str(tmp_path / "b"), seed=3)
    c = SCRIPT.write_checkpoint(str(tmp_path / "c"), seed=4)
    read = [(Path(p) / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert read[0] == read[1]
    assert read[0] != read[2]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensors_have_the_shapes_hf_expects(tmp_path, arch):
    path = Path(SCRIPT.write_checkpoint(str(tmp_path / arch), arch=arch))
    shape = SCRIPT.SHAPES["h512"]
    tensors = raw_tensors(path / "model.safetensors")
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    assert tensors["model.embed_tokens.weight"][1] == (shape["vocab_size"], hidden)
    assert tensors["lm_head.weight"][1] == (shape["vocab_size"], hidden)
    assert tensors["model.layers.7.self_attn.k_proj.weight"][1] == (kv, hidden)
    assert tensors["model.layers.7.mlp.down_proj.weight"][1] == (hidden, inter)
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == (arch == "qwen2")
    assert {dtype for dtype, _, _ in tensors.values()} == {"F32"}
    down = np.frombuffer(tensors["model.layers.0.mlp.down_proj.weight"][2], np.float32)
    assert abs(down.std() * np.sqrt(inter) - 1) < 0.01  # N(0, 1/fan_in)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [SCRIPT.ARCHITECTURES[arch]]
    assert config["eos_token_id"] is None


def test_bfloat16_file_is_the_float32_weights_rounded_to_nearest_even(tmp_path):
    f32 = raw_tensors(Path(SCRIPT.write_checkpoint(str(tmp_path / "f32"))) / "model.safetensors")
    bf16 = raw_tensors(
        Path(SCRIPT.write_checkpoint(str(tmp_path / "bf16"), dtype="bfloat16"))
        / "model.safetensors"
    )
    assert f32.keys() == bf16.keys()
    for name, (dtype, shape, data) in bf16.items():
        assert dtype == "BF16" and shape == f32[name][1], name
        widened = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        expected = nearest_bfloat16(np.frombuffer(f32[name][2], np.float32))
        np.testing.assert_array_equal(widened, expected, err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_our_loader_reads_it(tmp_path, arch):
    path = SCRIPT.write_checkpoint(str(tmp_path / arch), arch=arch, dtype="bfloat16")
    loaded = load_checkpoint(path)
    config = loaded.model.config
    shape = SCRIPT.SHAPES["h512"]
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (
        shape["hidden_size"],
        shape["num_hidden_layers"],
        shape["vocab_size"],
    )
    assert loaded.tokenizer.vocab_size == 2 + 256 + len(SCRIPT.MERGES)
    ids = loaded.tokenizer.encode("héllo the")
    assert ids[-1] == 2 + 256 + 3  # " the", the last merge
    assert loaded.tokenizer.decode(ids) == "héllo the"


def test_unknown_shape_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="argument 'shape'.*'h1'"):
        SCRIPT.write_checkpoint(str(tmp_path), shape="h1")

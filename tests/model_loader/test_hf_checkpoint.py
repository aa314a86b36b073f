"""Loading Hugging Face checkpoints, checked against what transformers computed on them
(tests/data/hf-tiny, see its README), and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

from paddle_step.config import EngineConfig, Llama3RopeScaling, ModelConfig
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.naive import generate_naive
from paddle_step.errors import CheckpointError
from paddle_step.layers.dense_blocks import onednn_available
from paddle_step.model_loader import weights
from paddle_step.model_loader.hf_config import model_config_from_hf
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.model_loader.weights import read_safetensors
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.tokenizer.hf import HFTokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "hf-tiny"
GOLDEN = json.loads((DATA / "golden.json").read_text())
MODELS = ("llama-tiny", "qwen2-tiny")
NEW_TOKENS = 40


def golden_prompts(name: str, dtype: str) -> list[dict]:
    return [entry for entry in GOLDEN["models"][name]["prompts"] if entry["dtype"] == dtype]


@pytest.fixture(scope="module", params=MODELS)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded64(name):
    return load_checkpoint(DATA / name, dtype="float64")


def test_metadata(loaded64, name) -> None:
    assert loaded64.name == name
    assert loaded64.eos_token_ids == [1]
    assert loaded64.max_model_len == 256
    config = loaded64.model.config
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings == (name == "qwen2-tiny")
    assert config.qkv_bias == (name == "qwen2-tiny")
    assert loaded64.tokenizer.eos_id == 1


def test_prompt_ids_match_transformers(loaded64, name) -> None:
    tokenizer = loaded64.tokenizer
    for entry in golden_prompts(name, "float64"):
        # golden.json's ids were made with add_special_tokens=False; these checkpoints'
        # post-processor adds nothing, so the default encoding gives the same ids.
        assert tokenizer.encode(entry["prompt"], add_special_tokens=False) == entry["prompt_ids"]
        assert tokenizer.encode(entry["prompt"]) == entry["prompt_ids"]


def test_float64_prefill_logits_match_transformers(loaded64, name) -> None:
    """Not 1e-9: transformers' "float64" Llama/Qwen2 computes RMSNorm in float32 (it casts
    to float32 inside the norm) and, per its source, the rotary angles too, so its logits carry
    float32 rounding, about 6e-7 of the largest logit here. (Checked on prompt "x", one token, no
    rotary: float32 norms, with one of the five rsqrt results one float32 ulp higher, as
    torch rounds it, reproduce its logits to 1e-16.) This model stays float64 throughout;
    the bound is that rounding with headroom, while a wrong layout or formula is off by 1e-2
    or more. The greedy ids below match exactly."""
    for index, entry in enumerate(golden_prompts(name, "float64")):
        expected = np.load(DATA / name / f"golden_prefill_logits_{index}.npy")
        got = loaded64.model.logits_all_positions(entry["prompt_ids"]).numpy()
        assert got.shape == expected.shape
        scale = np.abs(expected).max()
        assert np.abs(got - expected).max() <= 2e-6 * scale, entry["prompt"]


def test_float64_greedy_ids_match_transformers_naive(loaded64, name) -> None:
    entries = golden_prompts(name, "float64")
    results, _ = generate_naive(
        loaded64.model, [e["prompt_ids"] for e in entries], SamplingParams(max_tokens=NEW_TOKENS)
    )
    assert [r.token_ids for r in results] == [e["greedy_ids"] for e in entries]


# max_model_len 56 fits the longest prompt (12) + 40 tokens in 4-token blocks. Roomy: every
# slot can hold a whole sequence in each region. Tight: the decoder pool holds one sequence.
ROOMY = dict(num_kv_blocks=2 * 6 * 14, decoder_pool_ratio=0.5)
TIGHT = dict(num_kv_blocks=70, decoder_pool_ratio=0.2)


@pytest.mark.parametrize("budget", ["roomy", "tight"])
def test_float64_greedy_ids_match_transformers_engine(loaded64, name, budget) -> None:
    entries = golden_prompts(name, "float64")
    kv = ROOMY if budget == "roomy" else TIGHT
    engine = Engine(loaded64.model, EngineConfig(max_batch=6, max_model_len=56, block_size=4, **kv))
    # No tokenizer and no eos_token_id: no eos stop, as transformers generated them.
    results = engine.generate(
        [e["prompt_ids"] for e in entries], SamplingParams(max_tokens=NEW_TOKENS)
    )
    assert [r.token_ids for r in results] == [e["greedy_ids"] for e in entries]
    if budget == "tight":
        assert engine.stats.preemptions > 0
    else:
        assert engine.stats.preemptions == 0


@pytest.mark.parametrize("dense", ["auto", "eager", "op", "compiled"])
def test_float32_greedy_ids_match_transformers(name, dense, monkeypatch) -> None:
    """Exact too: the smallest top-2 logit gap along these paths is 1.4e-3, far above the
    float32 differences (~1e-6) between the implementations, whichever way the dense
    blocks run (measured per row count, or forced)."""
    if dense == "compiled" and not onednn_available("float32"):
        pytest.skip("compiled blocks need Paddle 3 with oneDNN on the CPU")
    monkeypatch.setenv("PADDLE_STEP_DENSE", dense)
    loaded = load_checkpoint(DATA / name, dtype="float32")
    entries = golden_prompts(name, "float32")
    prompts = [e["prompt_ids"] for e in entries]
    expected = [e["greedy_ids"] for e in entries]
    results, _ = generate_naive(loaded.model, prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == expected
    config = EngineConfig(max_batch=6, max_model_len=56, block_size=4, **ROOMY)
    engine = Engine(loaded.model, config)
    assert [
        r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    ] == expected


def test_decode_and_streaming_match_transformers(loaded64, name) -> None:
    tokenizer = loaded64.tokenizer
    for entry in golden_prompts(name, "float64"):
        assert tokenizer.decode(entry["greedy_ids"]) == entry["text"]
        stream = tokenizer.detokenizer(entry["prompt_ids"])
        pieces = [stream.add(token) for token in entry["greedy_ids"]]
        assert "".join(pieces) + stream.flush() == entry["text"]


def test_streaming_waits_for_whole_characters(loaded64) -> None:
    tokenizer = loaded64.tokenizer
    text = "naïve café ✓ 日本語 🚀 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # the BPE knows no non-ASCII: multi-byte chars span tokens
    stream = tokenizer.detokenizer()
    pieces = [stream.add(token) for token in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") > 0  # held back while a character was cut short


def test_encode_applies_the_checkpoints_post_processor(tmp_path) -> None:
    """A Llama-style post-processor that prepends <s>: encode adds it by default (as
    transformers' tokenizer(text) does), and a chat prompt, whose template writes its own
    <s>, does not get a second one."""
    path = copy_checkpoint(tmp_path, "llama-tiny")
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{{ messages[0]['content'] }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer.from_dir(path)
    assert tokenizer.encode("x") == [0, 89]
    assert tokenizer.encode("x", add_special_tokens=False) == [89]
    assert tokenizer.encode_chat([{"role": "user", "content": "x"}]) == [0, 89]


def test_chat_template(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer.from_dir(path)
    messages = [{"role": "user", "content": "def step("}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s>[user] def step(</s>[assistant] "
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1 and 1 in ids  # <s> once, </s> as one token
    assert tokenizer.decode(ids) == text
    no_template = HFTokenizer.from_dir(DATA / "llama-tiny")
    with pytest.raises(CheckpointError, match="chat_template"):
        no_template.apply_chat_template(messages)


# --- other layouts of the same weights -------------------------------------------------


def copy_checkpoint(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    shutil.copytree(DATA / name, path)
    for golden in path.glob("golden_*"):
        golden.unlink()
    return path


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, as uint16 bit patterns."""
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


@pytest.mark.parametrize("disk_dtype", ["bf16", "fp16"])
def test_half_precision_weights_load_as_rounded(tmp_path, disk_dtype) -> None:
    path = copy_checkpoint(tmp_path, "qwen2-tiny")
    original = read_safetensors(path / "model.safetensors")
    weights_file = path / "model.safetensors"
    if disk_dtype == "fp16":
        save_file({k: v.astype(np.float16) for k, v in original.items()}, str(weights_file))
        expected = {k: v.astype(np.float16).astype(np.float64) for k, v in original.items()}
    else:
        bits = {k: np.ascontiguousarray(to_bf16_bits(v)) for k, v in original.items()}
        specs = {
            k: safetensors.TensorSpec(
                dtype="bfloat16", shape=list(v.shape), data_ptr=v.ctypes.data, data_len=v.nbytes
            )
            for k, v in bits.items()
        }
        safetensors.serialize_file(specs, str(weights_file))
        expected = {
            k: (v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            for k, v in bits.items()
        }
    model = load_checkpoint(path, dtype="float64").model
    np.testing.assert_array_equal(model.embed.numpy(), expected["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        model.layers[1].wq.numpy(), expected["model.layers.1.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(
        model.layers[0].k_bias.numpy(), expected["model.layers.0.self_attn.k_proj.bias"]
    )
    embed = "model.embed_tokens.weight"
    assert np.abs(expected[embed] - original[embed]).max() > 0  # rounding did change values


def test_sharded_weights_load_like_one_file(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    tensors = read_safetensors(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({k: tensors[k] for k in shard_names}, str(path / shard))
    weight_map = {k: shard for shard, shard_names in shards.items() for k in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_checkpoint(path, dtype="float64").model
    single = load_checkpoint(DATA / "llama-tiny", dtype="float64").model
    for (key, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=key)

    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_checkpoint(path)


# --- configs: layouts and features -----------------------------------------------------


def base_config(**changes) -> dict:
    config = json.loads((DATA / "llama-tiny" / "config.json").read_text())
    config.update(changes)
    return config


def test_rope_layouts_and_llama3_scaling() -> None:
    top = model_config_from_hf(base_config(rope_theta=500000.0))
    nested = model_config_from_hf(
        base_config(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    )
    assert top.rope_theta == nested.rope_theta == 500000.0 and top.rope_scaling is None

    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    for config in (
        base_config(rope_scaling={"rope_type": "llama3", **llama3}),
        base_config(rope_scaling={"type": "llama3", **llama3}),
        base_config(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **llama3}),
    ):
        assert model_config_from_hf(config).rope_scaling == Llama3RopeScaling(**llama3)

    # Each band by its definition: wavelength below 64/4 kept, above 64/1 divided by 8,
    # between, interpolated by where 64/wavelength falls between 1 and 4.
    scaling = Llama3RopeScaling(**llama3)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    scaled = scaling.scale(inv_freq)
    for freq, got in zip(inv_freq, scaled):
        wavelength = 2 * np.pi / freq
        if wavelength < 16:
            assert got == freq
        elif wavelength > 64:
            assert got == pytest.approx(freq / 8, rel=1e-15)
        else:
            smooth = (64 / wavelength - 1) / 3
            assert got == pytest.approx((1 - smooth) * freq / 8 + smooth * freq, rel=1e-15)
    assert scaled[0] == inv_freq[0] and scaled[-1] == pytest.approx(inv_freq[-1] / 8)
    assert any(freq / 8 < got < freq for freq, got in zip(inv_freq, scaled))
    model = LlamaForCausalLM(
        model_config_from_hf(
            base_config(rope_scaling={"rope_type": "llama3", **llama3}), dtype="float64"
        )
    )
    np.testing.assert_array_equal(model.inv_freq.numpy(), scaled)


def test_head_dim_gqa_bias_and_tying_from_config() -> None:
    config = model_config_from_hf(
        base_config(
            head_dim=32,
            num_key_value_heads=1,
            attention_bias=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
        dtype="float64",
    )
    assert (config.head_dim, config.num_kv_heads, config.rms_eps) == (32, 1, 1e-5)
    assert config.qkv_bias and config.o_proj_bias and config.tie_word_embeddings
    derived = model_config_from_hf(base_config(head_dim=None, num_key_value_heads=None))
    assert (derived.head_dim, derived.num_kv_heads) == (16, 4)
    mistral = model_config_from_hf(
        base_config(architectures=["MistralForCausalLM"], sliding_window=256)
    )
    assert not mistral.qkv_bias

    # Such a model (MQA, head_dim * heads != hidden, all biases, tied) runs paged = naive.
    model = LlamaForCausalLM(config)
    assert model.lm_head is None and model.layers[0].wq.shape == [64, 128]
    prompt = [5, 9, 200, 7, 7, 31]
    tail = model.logits_all_positions(prompt).numpy()[-1]
    np.testing.assert_allclose(model.forward_naive([prompt]).numpy()[0], tail, rtol=1e-12)
    engine = Engine(
        model, EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16)
    )
    paged = engine.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    naive = generate_naive(model, [prompt], SamplingParams(max_tokens=6))[0][0].token_ids
    assert paged == naive


def test_random_model_unchanged_by_default_fields() -> None:
    config = ModelConfig()
    assert config.head_dim == 16 and not config.tie_word_embeddings and not config.qkv_bias
    names = {name for name, _ in LlamaForCausalLM(config).named_parameters()}
    assert "lm_head" in names and not any("bias" in name for name in names)


# --- refusals ----------------------------------------------------------------------------

REFUSED_CONFIGS = {
    "architecture": (dict(architectures=["GPTNeoXForCausalLM"]), "architectures"),
    "no architecture": (dict(architectures=None), "architectures"),
    "moe": (dict(num_local_experts=8, num_experts_per_tok=2), "mixture-of-experts"),
    "mistral window": (
        dict(architectures=["MistralForCausalLM"], sliding_window=128),
        "sliding_window",
    ),
    "qwen2 window": (
        dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True),
        "use_sliding_window",
    ),
    "layer types": (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    "rope type": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    "rope type nested": (
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
        "rope_type",
    ),
    "llama3 incomplete": (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        "low_freq_factor",
    ),
    "partial rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "activation": (dict(hidden_act="gelu"), "hidden_act"),
    "mlp bias": (dict(mlp_bias=True), "mlp_bias"),
    "missing field": (dict(hidden_size=None), "hidden_size"),
    "bad heads": (dict(num_key_value_heads=3), "num_heads"),
    # Named once: a field's own refusal is not wrapped in another "config.json: ".
    "zero layers": (
        dict(num_hidden_layers=0),
        "^config.json: field 'num_hidden_layers': expected a positive int, got 0$",
    ),
    "eps a string": (
        dict(rms_norm_eps="x"),
        "field 'rms_norm_eps': expected a positive number, got 'x'",
    ),
}


@pytest.mark.parametrize("case", REFUSED_CONFIGS)
def test_unsupported_configs_are_refused(tmp_path, case) -> None:
    changes, fragment = REFUSED_CONFIGS[case]
    path = copy_checkpoint(tmp_path, "llama-tiny")
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=fragment):
        load_checkpoint(path)


@pytest.mark.parametrize("path", [None, 5, b"llama-tiny"])
def test_a_path_that_is_not_a_path_is_refused_by_name(path) -> None:
    with pytest.raises(TypeError, match="argument 'path': expected a str or os.PathLike, got"):
        load_checkpoint(path)


def test_a_config_that_is_not_a_json_object_is_refused(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json: expected a JSON object, got list"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "missing, fragment",
    [
        ("config.json", "config.json"),
        ("model.safetensors", "model.safetensors"),
        ("tokenizer.json", "tokenizer.json"),
    ],
)
def test_missing_files_are_refused(tmp_path, missing, fragment) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    (path / missing).unlink()
    with pytest.raises(CheckpointError, match=fragment):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="directory"):
        load_checkpoint(tmp_path / "nowhere")


def test_weights_not_matching_the_config_are_refused(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    edit_config(path, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.2"):
        load_checkpoint(path)
    edit_config(path, num_hidden_layers=2, intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"layers.0.w_gate.*expected shape \[64, 128\]"):
        load_checkpoint(path)
    edit_config(path, intermediate_size=160, tie_word_embeddings=True)
    load_checkpoint(path)  # a tied checkpoint may keep lm_head.weight: ignored
    edit_config(path, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_checkpoint(path)


def test_tokenizer_larger_than_embedding_is_refused(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    edit_config(path, vocab_size=300)
    with pytest.raises(CheckpointError, match="tokenizer has 400 ids.*300 rows"):
        load_checkpoint(path)


def test_eos_ids_prefer_generation_config_and_accept_lists(tmp_path) -> None:
    path = copy_checkpoint(tmp_path, "llama-tiny")
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, 0]
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert load_checkpoint(path).eos_token_ids == [1, 0]
    (path / "generation_config.json").unlink()
    edit_config(path, eos_token_id=[0, 1])
    assert load_checkpoint(path).eos_token_ids == [0, 1]
    edit_config(path, eos_token_id="</s>")
    with pytest.raises(CheckpointError, match="eos_token_id"):
        load_checkpoint(path)
    edit_config(path, eos_token_id=[1, 999])
    with pytest.raises(CheckpointError, match=r"\[999\]"):
        load_checkpoint(path)


@pytest.mark.parametrize("rows", [1, weights.TRANSPOSE_ROWS, weights.TRANSPOSE_ROWS + 3, 600])
def test_weights_are_transposed_and_cast_in_one_copy(rows):
    """A Linear weight comes out as [in, out], C-contiguous, in the model's dtype, whatever its
    row count against the slices the copy moves; a weight already in place is copied too
    (the source may map the checkpoint's file)."""
    source = np.random.default_rng(rows).standard_normal((rows, 37))
    for dtype in ("float32", "float64"):
        moved = weights._in_layout(source, dtype, transpose=True)
        assert moved.flags.c_contiguous and moved.dtype == dtype
        np.testing.assert_array_equal(moved, source.T.astype(dtype))
    kept = weights._in_layout(source, "float64", transpose=False)
    np.testing.assert_array_equal(kept, source)
    assert not np.shares_memory(kept, source)


def test_a_broken_safetensors_file_is_refused_by_name(tmp_path):
    """The file is checked before it is mapped: cut short, empty or not safetensors at all,
    it is refused with its path, and a whole one reads back exactly."""
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float16)}
    whole = tmp_path / "whole.safetensors"
    save_file(tensors, whole)
    read = read_safetensors(whole)
    assert read.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(read[name], array)
    data = whole.read_bytes()
    for what, content in (
        ("cut", data[:-6]),
        ("empty", b""),
        ("text", b"\x05" + bytes(7) + b"hello"),
    ):
        broken = tmp_path / f"{what}.safetensors"
        broken.write_bytes(content)
        with pytest.raises(
            CheckpointError, match=f"{what}.safetensors: not a readable safetensors"
        ):
            read_safetensors(broken)


def test_a_file_that_cannot_be_mapped_is_read(tmp_path, monkeypatch):
    """On a file system without memory maps the file is read instead, with the same arrays."""
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_file(tensors, tmp_path / "model.safetensors")

    def no_map(*_args, **_kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(weights.mmap, "mmap", no_map)
    np.testing.assert_array_equal(
        read_safetensors(tmp_path / "model.safetensors")["w"], tensors["w"]
    )


@pytest.mark.parametrize(
    "header",
    [b"[1, 2]", b'{"w": {"shape": [1]}}', b'{"w": 5}', b"not json"],
    ids=["a list", "no dtype", "an entry not an object", "not JSON"],
)
def test_a_header_that_is_not_safetensors_is_refused_by_name(tmp_path, header):
    """The dtype probe (``load_checkpoint``'s dtype "auto") reads headers alone; one it
    cannot read is refused with the file's path, not a Python error."""
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors"):
        weights.stored_dtypes(tmp_path)
    save_file({"w": np.ones(2, np.float32)}, tmp_path / "model.safetensors")
    assert weights.stored_dtypes(tmp_path) == {"F32"}

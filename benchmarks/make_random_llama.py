#!/usr/bin/env python
"""Write a random-weight Hugging Face Llama or Qwen2 checkpoint: nothing is downloaded.

The folder gets ``config.json``, ``model.safetensors`` (float32 or bfloat16), a byte-level
BPE ``tokenizer.json`` (``<s>``, ``</s>``, the 256 bytes and four merges) and its
``tokenizer_config.json``. vLLM, llama.cpp's ``convert_hf_to_gguf.py`` and
``paddle_step.model_loader.load_checkpoint`` all read it. The benchmarks feed token ids, so
the tokenizer only has to exist; the vocabulary (the embedding's rows) is the shape's.

The weights depend only on the shape and ``--seed``: the same seed gives the same bytes, and
the bfloat16 file holds the float32 values rounded to nearest even, so both dtypes are the
same model. Linear weights are N(0, 1/fan_in) (activations stay O(1) through the layers),
embeddings N(0, 1), norm weights 1 + N(0, 0.1^2), Qwen2's q/k/v biases N(0, 0.1^2).

Tensors are generated and written one at a time, so the 0.5B shape never holds its 2 GB of
float32 weights in memory at once.

Usage: make_random_llama.py OUT_DIR [--shape h512|qwen2.5-0.5b] [--arch llama|qwen2]
                            [--dtype float32|bfloat16] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np

# HF config.json fields of the shapes the CPU benchmarks use.
SHAPES = {
    # The small shape of issue 28's table.
    "h512": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1408,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
    },
    # Qwen2.5-0.5B's dimensions (its LM head is the embedding).
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    # A model of seconds, for quick runs (bench_weight_formats.py --quick).
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 160,
        "vocab_size": 3000,
        "tie_word_embeddings": True,
    },
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = ("float32", "bfloat16")
# safetensors' names of the dtypes.
SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16"}
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2}
SPECIAL_TOKENS = ("<s>", "</s>")
# A few merges (" t", "he", "in", " the"): llama.cpp refuses a BPE vocabulary without any.
MERGES = (("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"))


def tensor_specs(shape: dict, arch: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in the order they are generated and written.
    kind: 'embedding', 'linear' (HF layout [out, in]), 'norm' or 'bias'."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    q_width = shape["num_attention_heads"] * head_dim
    kv_width = shape["num_key_value_heads"] * head_dim
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]
    specs = [("model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        specs.append((f"{prefix}.input_layernorm.weight", (hidden,), "norm"))
        for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            specs.append((f"{prefix}.self_attn.{name}.weight", (width, hidden), "linear"))
            if arch == "qwen2":
                specs.append((f"{prefix}.self_attn.{name}.bias", (width,), "bias"))
        specs.append((f"{prefix}.self_attn.o_proj.weight", (hidden, q_width), "linear"))
        specs.append((f"{prefix}.post_attention_layernorm.weight", (hidden,), "norm"))
        specs.append((f"{prefix}.mlp.gate_proj.weight", (inter, hidden), "linear"))
        specs.append((f"{prefix}.mlp.up_proj.weight", (inter, hidden), "linear"))
        specs.append((f"{prefix}.mlp.down_proj.weight", (hidden, inter), "linear"))
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not shape["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, hidden), "linear"))
    return specs


def random_tensor(rng: np.random.Generator, dims: tuple[int, ...], kind: str) -> np.ndarray:
    values = rng.standard_normal(dims, dtype=np.float32)
    if kind == "linear":
        values *= np.float32(1.0 / np.sqrt(dims[1]))
    elif kind == "norm":
        values = np.float32(1.0) + np.float32(0.1) * values
    elif kind == "bias":
        values *= np.float32(0.1)
    return values


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (no NaN here)."""
    bits = values.view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: str, specs: list, dtype: str, seed: int) -> None:
    """The safetensors layout: an 8-byte little-endian header size, a JSON header of
    name -> dtype/shape/byte range, then the tensors' bytes back to back."""
    header, offset = {}, 0
    for name, dims, _ in specs:
        size = int(np.prod(dims)) * BYTES_PER_ELEMENT[dtype]
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[dtype],
            "shape": list(dims),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for _, dims, kind in specs:
            values = random_tensor(rng, dims, kind)
            data = values if dtype == "float32" else to_bfloat16_bits(values)
            file.write(np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())


def byte_level_alphabet() -> list[str]:
    """The 256 characters byte-level BPE uses for the bytes 0..255: printable Latin-1
    bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return [chars[byte] for byte in range(256)]


def tokenizer_json() -> dict:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in byte_level_alphabet():
        vocab[char] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(pair) for pair in MERGES],
        },
    }


def config_json(shape: dict, arch: str, dtype: str) -> dict:
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        **shape,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if arch == "qwen2" else 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        # No eos: a random model would stop at random; benchmarks generate a fixed count.
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def write_checkpoint(
    out_dir: str, shape: str = "h512", arch: str = "llama", dtype: str = "float32", seed: int = 0
) -> str:
    """Writes the checkpoint into ``out_dir`` (created if missing) and returns it."""
    if shape not in SHAPES:
        raise ValueError(f"argument 'shape': expected one of {list(SHAPES)}, got {shape!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"argument 'arch': expected one of {list(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"argument 'dtype': expected one of {list(DTYPES)}, got {dtype!r}")
    os.makedirs(out_dir, exist_ok=True)
    dims = SHAPES[shape]
    write_safetensors(
        os.path.join(out_dir, "model.safetensors"), tensor_specs(dims, arch), dtype, seed
    )
    files = {
        "config.json": config_json(dims, arch, dtype),
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[1],
            "add_bos_token": False,
            "model_max_length": 4096,
        },
    }
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w") as file:
            json.dump(content, file, indent=1, ensure_ascii=False)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=list(SHAPES), default="h512")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default="llama")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_checkpoint(args.out_dir, args.shape, args.arch, args.dtype, args.seed)
    print(
        f"wrote {args.out_dir} ({args.shape}, {args.arch}, {args.dtype}, seed {args.seed})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()

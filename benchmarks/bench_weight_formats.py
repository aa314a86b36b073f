#!/usr/bin/env python
"""Memory and decode speed of the weight formats (float32, bfloat16, int8) on one shape.

Writes a random checkpoint of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query and 2
KV heads, intermediate 4864, vocabulary 151,936, tied embeddings, q/k/v biases) stored in
bfloat16, as published checkpoints are. Then, for each format in turn, a fresh process
loads it (``--dtype float32``, ``--dtype bfloat16``, ``--quantization int8``) and reports:

- the resident set (VmRSS) before and after the load, and the bytes of the weights the
  model keeps (its parameters and packed tensors);
- tokens/s of greedy generation through the engine (prefill included): B requests at
  once, each a 64-token prompt of random ids and 32 new tokens, for B in 1 and 8, on the
  engine's default threads (every core it may use).

The formats run one after another in the same run (this machine is shared: compare within
a run). ``--quick``: a tiny shape, for the smoke test.

Usage: bench_weight_formats.py [--quick] [--json] [--checkpoint DIR] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import layer_projections, whole_batch_config
from make_random_llama import SHAPES

FORMATS = {
    "float32": ("--dtype", "float32"),
    "bfloat16": ("--dtype", "bfloat16"),
    "int8": ("--quantization", "int8"),
}
PROMPT_LEN, NEW_TOKENS, BLOCK_SIZE = 64, 32, 16
TOKENIZER_DIR = (
    Path(__file__).resolve().parents[1] / "python" / "paddle_step" / "assets" / "pydoc-tiny"
)


def bfloat16_bits(array: np.ndarray) -> np.ndarray:
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_checkpoint(path: Path, shape: dict, seed: int = 0) -> None:
    """A Qwen2 checkpoint directory with random weights stored in bfloat16."""
    import safetensors

    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads = (
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    head_dim = hidden // heads
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]

    def normal(*dims: int, scale: float = 1.0) -> np.ndarray:
        return bfloat16_bits(rng.standard_normal(dims, dtype=np.float32) * np.float32(scale))

    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": bfloat16_bits(np.ones(hidden, np.float32)),
    }
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = bfloat16_bits(np.ones(hidden, np.float32))
        for name, out_width, in_width in layer_projections(hidden, q_width, kv_width, inter):
            # HF layout [out, in]; 1/sqrt(fan_in) keeps the activations O(1).
            tensors[f"{prefix}.{name}.weight"] = normal(out_width, in_width, scale=in_width**-0.5)
        for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            tensors[f"{prefix}.self_attn.{name}.bias"] = normal(width, scale=0.1)
    specs = {
        name: safetensors.TensorSpec(
            dtype="bfloat16",
            shape=list(bits.shape),
            data_ptr=bits.ctypes.data,
            data_len=bits.nbytes,
        )
        for name, bits in tensors.items()
    }
    safetensors.serialize_file(specs, str(path / "model.safetensors"))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **shape,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "eos_token_id": None,  # no stop: every request generates NEW_TOKENS
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((TOKENIZER_DIR / name).read_bytes())


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(model) -> int:
    """Bytes of the weights ``model`` keeps: its parameters, the dense blocks' fused and
    packed copies, and a packed embedding (each tensor counted once)."""
    from paddle_step.layers.dense_blocks import DenseWeight

    tensors = {id(p): p for p in model.parameters()}
    weights = [w for layer in model.layers for w in layer._dense_weights()]
    for weight in [*weights, model._embedding, model._lm_head]:
        if isinstance(weight, DenseWeight):
            packed = weight.packed
            found = [weight.tensor] + ([] if packed is None else [packed.weights, packed.scales])
        else:
            found = [weight]  # a fused bias, or None
        tensors.update((id(t), t) for t in found if t is not None)
    return sum(math.prod(t.shape) * t.element_size() for t in tensors.values())


def child(checkpoint: str, weight_format: str, batches: list[int]) -> dict:
    """One format, in this (fresh) process."""
    import paddle

    from paddle_step.engine.llm_engine import Engine
    from paddle_step.model_loader.loader import load_checkpoint
    from paddle_step.sampling_params import SamplingParams

    paddle.set_device("cpu")
    flag, value = FORMATS[weight_format]
    before = resident_bytes()
    started = time.perf_counter()
    dtype = value if flag == "--dtype" else "auto"
    quantization = value if flag == "--quantization" else None
    model = load_checkpoint(checkpoint, dtype, quantization).model
    load_s = time.perf_counter() - started
    after = resident_bytes()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    runs = {}
    for batch in batches:
        config = whole_batch_config(batch, PROMPT_LEN + NEW_TOKENS, BLOCK_SIZE)
        prompts = rng.integers(0, vocab, (batch, PROMPT_LEN)).tolist()
        engine = Engine(model, config)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warms the row classes up
        engine.generate(prompts, SamplingParams(max_tokens=2))
        started = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
        elapsed = time.perf_counter() - started
        assert all(len(r.token_ids) == NEW_TOKENS for r in results)
        runs[str(batch)] = {"tokens_per_s": batch * NEW_TOKENS / elapsed, "seconds": elapsed}
    return {
        "format": weight_format,
        "rss_before_load_mb": before / 2**20,
        "rss_after_load_mb": after / 2**20,
        "rss_after_runs_mb": resident_bytes() / 2**20,
        "weight_mb": weight_bytes(model) / 2**20,  # after the runs: lazy copies made
        "load_s": load_s,
        "batches": runs,
    }


def run_child(checkpoint: Path, weight_format: str, batches: list[int]) -> dict:
    command = [sys.executable, __file__, "--child", weight_format, "--checkpoint", str(checkpoint)]
    command += ["--batches", ",".join(map(str, batches))]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if completed.returncode != 0:
        raise SystemExit(f"{weight_format}: {completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, B = 1 and 2")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--checkpoint", help="a checkpoint written by an earlier run (kept)")
    parser.add_argument("--batches", help="comma-separated B values (default 1,8)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument("--child", choices=FORMATS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,8")).split(",")]
    if args.child:
        print(json.dumps(child(args.checkpoint, args.child, batches)))
        return {}

    from paddle_step.layers import cpu_linear

    shape = SHAPES["tiny" if args.quick else "qwen2.5-0.5b"]
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(scratch) / "model"
        if not (checkpoint / "model.safetensors").is_file():
            checkpoint.mkdir(parents=True, exist_ok=True)
            write_checkpoint(checkpoint, shape)
        results = [run_child(checkpoint, name, batches) for name in args.formats.split(",")]
    report = {
        "env": {
            "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0)),
            "isa": cpu_linear.best_isa(),
            "python": platform.python_version(),
        },
        "config": {
            "shape": shape,
            "prompt_len": PROMPT_LEN,
            "new_tokens": NEW_TOKENS,
            "batches": batches,
        },
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
    else:
        env = report["env"]
        print(f"{env['cpu']}, {env['cores']} cores, op path {env['isa']}")
        header = "format    weights MB  RSS before/after load MB  " + "  ".join(
            f"B={b} tok/s" for b in batches
        )
        print(header)
        for row in results:
            speeds = "  ".join(f"{row['batches'][str(b)]['tokens_per_s']:11.1f}" for b in batches)
            print(
                f"{row['format']:9} {row['weight_mb']:10.0f}  {row['rss_before_load_mb']:8.0f} / "
                f"{row['rss_after_load_mb']:8.0f}        {speeds}"
            )
    return report


if __name__ == "__main__":
    main()

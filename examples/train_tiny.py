"""Train the tiny Llama-shaped default model on CPython's pydoc topics; save it in the HF layout.

The corpus is ``pydoc_data.topics`` (the help() texts every CPython installation ships). A
deterministic 5% of the topics is held out; train paragraphs that also occur in a held-out
topic are dropped, because many topics repeat each other's text (e.g. "compound" contains
"for") and the held-out loss should measure text the model has not seen. The script trains
a byte-level BPE tokenizer, trains the model on random windows of the token stream with
AdamW, saves config.json, generation_config.json, model.safetensors (float16), tokenizer.json
and tokenizer_config.json, then checks the saved files with an independent numpy forward.

    python examples/train_tiny.py                      # train, save, verify (CPU, ~15 min)
    python examples/train_tiny.py --max-minutes 1 --out /tmp/tiny   # a quick smoke run
    python examples/train_tiny.py --verify-only        # numpy check of the shipped files
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import pydoc_data.topics
import sys
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<s>", "</s>"
# The chat template written to tokenizer_config.json, so /v1/chat/completions works on
# the shipped model: each message as "Role: content" and a blank line, then "Assistant:".
# The model never saw chats in training; this only gives chat clients a well-formed prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "python" / "paddle_step" / "assets" / "pydoc-tiny"
DEFAULT_PROMPTS = ["The for statement", "def ", "A list is", 'The "import" statement']


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="checkpoint folder; the default is the shipped one",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and batch order")
    shape = parser.add_argument_group("model shape")
    for flag, default, text in (
        ("--vocab-size", 2048, "BPE vocabulary size"),
        ("--hidden-size", 128, "model width"),
        ("--layers", 4, "decoder layers"),
        ("--heads", 4, "query heads"),
        ("--kv-heads", 2, "key/value heads (GQA)"),
        ("--intermediate-size", 384, "SwiGLU width"),
    ):
        shape.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument("--context", type=int, default=256, help="training window, tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per step")
    parser.add_argument(
        "--steps",
        type=int,
        default=3000,
        help="most optimizer steps; the run ends at --steps or --max-minutes, "
        "whichever comes first, and the LR schedule follows the nearer one",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=13.0,
        help="wall-clock budget of the training loop; 0: no clock, --steps only (bit-reproducible)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR / --lr (cosine)")
    parser.add_argument("--warmup-steps", type=int, default=50, help="linear LR warmup")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW, matrices only")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between evaluations")
    parser.add_argument("--max-new-tokens", type=int, default=60, help="for the sample outputs")
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="a prompt for the sample outputs (repeatable); default: a few",
    )
    parser.add_argument(
        "--verify-only",
        action="store_true",
        help="skip training; check the checkpoint in --out with numpy",
    )
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- data


def load_corpus() -> tuple[list[str], list[str], str]:
    """Return (train paragraphs joined per topic, held-out topics, sha256 of the corpus)."""
    topics = pydoc_data.topics.topics
    names = sorted(topics)
    digest = hashlib.sha256("\0".join(n + "\0" + topics[n] for n in names).encode()).hexdigest()
    heldout_names = [n for i, n in enumerate(names) if i % 20 == 10]  # 5%, spread alphabetically
    heldout = [topics[n] for n in heldout_names]
    heldout_paragraphs = {p.strip() for text in heldout for p in text.split("\n\n")}
    train = []
    for name in names:
        if name in heldout_names:
            continue
        kept = [p for p in topics[name].split("\n\n") if p.strip() not in heldout_paragraphs]
        train.append("\n\n".join(kept))
    return train, heldout, digest


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text encodes) whose post-processor prepends BOS, as Llama's does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenate ``<s> text </s>`` for every text: what the model sees in training."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int64)


# ----------------------------------------------------------------------------- model (Paddle)


class Linear(nn.Layer):
    """Bias-free linear layer whose weight is [out, in], the HF layout (paddle's is [in, out])."""

    def __init__(self, in_features: int, out_features: int, std: float):
        super().__init__()
        self.weight = self.create_parameter(
            [out_features, in_features], default_initializer=nn.initializer.Normal(0.0, std)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.weight, transpose_y=True)


class RMSNorm(nn.Layer):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [size], default_initializer=nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Layer):
    def __init__(self, cfg: dict, std: float, out_std: float):
        super().__init__()
        hidden, self.heads, self.kv_heads = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        )
        self.head_dim = cfg["head_dim"]
        self.q_proj = Linear(hidden, self.heads * self.head_dim, std)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, std)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, std)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, out_std)

    def forward(self, x, cos, sin, mask):
        batch, length, _ = x.shape

        def split_heads(t, heads):  # [B, T, heads * D] -> [B, heads, T, D]
            return t.reshape([batch, length, heads, self.head_dim]).transpose([0, 2, 1, 3])

        q = split_heads(self.q_proj(x), self.heads)
        k = split_heads(self.k_proj(x), self.kv_heads)
        v = split_heads(self.v_proj(x), self.kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # GQA as HF's repeat_kv: query head h reads KV head h // (heads / kv_heads).
        k = paddle.repeat_interleave(k, self.heads // self.kv_heads, axis=1)
        v = paddle.repeat_interleave(v, self.heads // self.kv_heads, axis=1)
        scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim) + mask
        out = paddle.matmul(F.softmax(scores, axis=-1), v)
        return self.o_proj(out.transpose([0, 2, 1, 3]).reshape([batch, length, -1]))


class MLP(nn.Layer):
    def __init__(self, hidden: int, intermediate: int, std: float, out_std: float):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, std)
        self.up_proj = Linear(hidden, intermediate, std)
        self.down_proj = Linear(intermediate, hidden, out_std)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Layer):
    def __init__(self, cfg: dict, std: float, out_std: float):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg, std, out_std)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"], std, out_std)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Layer):
    def __init__(self, cfg: dict, std: float, out_std: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(
            cfg["vocab_size"],
            cfg["hidden_size"],
            weight_attr=paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, std)),
        )
        self.layers = nn.LayerList(
            [DecoderLayer(cfg, std, out_std) for _ in range(cfg["num_hidden_layers"])]
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class LlamaForCausalLM(nn.Layer):
    """Training-only Llama; its state_dict keys are the HF names. The LM head is tied."""

    def __init__(self, cfg: dict):
        super().__init__()
        std = cfg["initializer_range"]
        # Residual-branch outputs start smaller (GPT-2's 1/sqrt(2 * layers)) so the residual
        # stream's scale does not grow with depth at initialisation.
        out_std = std / math.sqrt(2 * cfg["num_hidden_layers"])
        self.model = LlamaModel(cfg, std, out_std)
        half = cfg["head_dim"] // 2
        self.inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(half, dtype=np.float64) / half)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        length = ids.shape[1]
        angles = np.outer(np.arange(length), self.inv_freq)
        angles = np.concatenate([angles, angles], axis=-1)  # HF layout: cos/sin repeat per half
        cos = paddle.to_tensor(np.cos(angles), dtype="float32")
        sin = paddle.to_tensor(np.sin(angles), dtype="float32")
        mask = paddle.to_tensor(np.triu(np.full((length, length), -np.inf, np.float32), 1))
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        return paddle.matmul(x, self.model.embed_tokens.weight, transpose_y=True)


def window_loss(model: LlamaForCausalLM, windows: np.ndarray) -> paddle.Tensor:
    """Mean next-token cross-entropy over ``windows`` [B, context + 1]."""
    windows = paddle.to_tensor(windows)
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), windows[:, 1:].reshape([-1]))


def eval_windows(tokens: np.ndarray, context: int) -> np.ndarray:
    """Non-overlapping windows covering ``tokens``; the deterministic evaluation set."""
    count = (len(tokens) - 1) // context
    return np.stack([tokens[i * context : i * context + context + 1] for i in range(count)])


@paddle.no_grad()
def evaluate(model: LlamaForCausalLM, windows: np.ndarray, batch_size: int) -> float:
    model.eval()
    losses = [
        float(window_loss(model, windows[i : i + batch_size])) * len(windows[i : i + batch_size])
        for i in range(0, len(windows), batch_size)
    ]
    model.train()
    return sum(losses) / len(windows)


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over steps, then cosine decay to --lr * --min-lr-ratio as progress -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def progress_of(step: int, elapsed: float, args: argparse.Namespace) -> float:
    """Fraction of the run done: by steps, or by the clock if that is further along, so the
    LR has fully decayed when the run ends however busy the machine is."""
    by_clock = elapsed / (args.max_minutes * 60) if args.max_minutes > 0 else 0.0
    return max(step / args.steps, by_clock)


def train(
    model: LlamaForCausalLM,
    train_tokens: np.ndarray,
    heldout: np.ndarray,
    train_eval: np.ndarray,
    args: argparse.Namespace,
) -> dict:
    decay = {p.name for p in model.parameters() if p.ndim == 2}  # not the norm gains
    optimizer = paddle.optimizer.AdamW(
        learning_rate=args.lr,
        beta1=0.9,
        beta2=0.95,
        weight_decay=args.weight_decay,
        parameters=model.parameters(),
        grad_clip=nn.ClipGradByGlobalNorm(1.0),
        apply_decay_param_fun=lambda name: name in decay,
    )
    rng = np.random.default_rng(args.seed)
    history = []
    start = time.perf_counter()

    def record_eval(step: int) -> None:
        history.append(
            dict(
                step=step,
                minutes=round((time.perf_counter() - start) / 60, 2),
                train_loss=round(evaluate(model, train_eval, args.batch_size), 4),
                heldout_loss=round(evaluate(model, heldout, args.batch_size), 4),
            )
        )
        print("eval", history[-1], flush=True)

    step = 0
    while (progress := progress_of(step, time.perf_counter() - start, args)) < 1.0:
        lr = lr_at(step, progress, args)
        starts = rng.integers(0, len(train_tokens) - args.context - 1, args.batch_size)
        batch = np.stack([train_tokens[s : s + args.context + 1] for s in starts])
        optimizer.set_lr(lr)
        loss = window_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        step += 1
        if step % 20 == 0 or step == 1:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}  loss {float(loss):.3f}  lr {lr:.2e}  "
                f"{step * batch.size / elapsed:,.0f} tok/s  {elapsed / 60:.1f} min",
                flush=True,
            )
        if step % args.eval_every == 0:
            record_eval(step)
    if not history or history[-1]["step"] != step:
        record_eval(step)
    return dict(steps=step, train_minutes=history[-1]["minutes"], history=history)


# ----------------------------------------------------------------------------- checkpoint


def model_config(args: argparse.Namespace, tokenizer: Tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden_size // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "use_cache": True,
        "torch_dtype": "float16",
        "dtype": "float16",
    }


def save_checkpoint(out: Path, model: LlamaForCausalLM, cfg: dict, tokenizer: Tokenizer) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: param.numpy().astype(np.float16) for name, param in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2
        )
        + "\n"
    )
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": True,  # informational: tokenizer.json's post-processor adds it
                "add_eos_token": False,
                "model_max_length": cfg["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )


# ----------------------------------------------------------------------------- numpy check


def numpy_forward(weights: dict[str, np.ndarray], cfg: dict, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] of the HF Llama in ``weights``/``cfg``, written from the HF recipe."""
    w = {name: value.astype(np.float32) for name, value in weights.items()}
    heads, kv_heads, head_dim = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    length = len(ids)

    def rms_norm(x, gain):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * gain

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(length), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]

    def rope(t):  # [T, heads, D]
        return (
            t * cos + np.concatenate([-t[..., head_dim // 2 :], t[..., : head_dim // 2]], -1) * sin
        )

    causal = np.triu(np.full((length, length), -np.inf), 1)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(length, heads, head_dim))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(length, kv_heads, head_dim))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(length, kv_heads, head_dim)
        k, v = (np.repeat(t, heads // kv_heads, axis=1) for t in (k, v))
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(length, heads * head_dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def numpy_loss(weights: dict, cfg: dict, windows: np.ndarray) -> float:
    losses = []
    for window in windows:
        logits = numpy_forward(weights, cfg, window[:-1].tolist())
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        losses.append(-logp[np.arange(len(window) - 1), window[1:]].mean())
    return float(np.mean(losses))


def greedy_generate(
    weights: dict, cfg: dict, tokenizer: Tokenizer, prompt: str, max_new_tokens: int
) -> str:
    ids = tokenizer.encode(prompt).ids  # the post-processor prepends <s>
    prompt_len = len(ids)
    while len(ids) - prompt_len < max_new_tokens and len(ids) < cfg["max_position_embeddings"]:
        next_id = int(numpy_forward(weights, cfg, ids)[-1].argmax())
        if next_id == cfg["eos_token_id"]:
            break
        ids.append(next_id)
    return tokenizer.decode(ids, skip_special_tokens=True)


def verify(
    out: Path,
    heldout: np.ndarray,
    prompts: list[str],
    max_new_tokens: int,
    model: LlamaForCausalLM | None,
) -> dict:
    """Reload the saved files and check them with numpy; return held-out loss and samples."""
    weights = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    report = {}
    if model is not None:
        # Give the Paddle model the saved float16 values, so both sides hold identical weights
        # and any mismatch is a layout or recipe error, not rounding.
        model.set_state_dict(
            {n: paddle.to_tensor(v.astype(np.float32)) for n, v in weights.items()}
        )
        model.eval()
        window = heldout[0, :-1]
        with paddle.no_grad():
            expected = model(paddle.to_tensor(window[None]))[0].numpy()
        got = numpy_forward(weights, cfg, window.tolist())
        report["max_abs_logit_diff"] = float(np.abs(got - expected).max())
        report["argmax_agreement"] = float((got.argmax(-1) == expected.argmax(-1)).mean())
        print(
            f"numpy vs paddle logits on a held-out window: max |diff| "
            f"{report['max_abs_logit_diff']:.2e} (logits span "
            f"{expected.min():.1f}..{expected.max():.1f}), argmax agreement "
            f"{report['argmax_agreement']:.3f}"
        )
        assert report["max_abs_logit_diff"] < 1e-2 and report["argmax_agreement"] > 0.99
    report["heldout_loss_numpy_fp16"] = round(numpy_loss(weights, cfg, heldout), 4)
    print(
        f"held-out loss, numpy forward of the saved float16 weights: "
        f"{report['heldout_loss_numpy_fp16']:.4f}"
    )
    report["samples"] = {}
    for prompt in prompts:
        text = greedy_generate(weights, cfg, tokenizer, prompt, max_new_tokens)
        report["samples"][prompt] = text
        print(f"--- greedy, {prompt!r}:\n{text}\n", flush=True)
    return report


def display_path(path: Path) -> str:
    """``path`` relative to the repository when inside it, so the summary names no home dir."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paddle.set_device("cpu")
    paddle.seed(args.seed)
    prompts = args.prompt or DEFAULT_PROMPTS
    train_texts, heldout_texts, corpus_sha256 = load_corpus()
    if args.verify_only:
        tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
        context = json.loads((args.out / "config.json").read_text())["max_position_embeddings"]
        verify(
            args.out,
            eval_windows(token_stream(tokenizer, heldout_texts), context),
            prompts,
            args.max_new_tokens,
            model=None,
        )
        return 0

    started = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_tokens = token_stream(tokenizer, train_texts)
    heldout = eval_windows(token_stream(tokenizer, heldout_texts), args.context)
    # Same size as the held-out set, from the training stream: train vs held-out loss on
    # equal footing shows how much the model memorises.
    train_eval = eval_windows(train_tokens, args.context)[::7][: len(heldout)]
    print(
        f"corpus: {len(train_texts)} train topics ({sum(map(len, train_texts)):,} chars, "
        f"{len(train_tokens):,} tokens), {len(heldout_texts)} held-out topics "
        f"({len(heldout)} windows of {args.context}); vocab {tokenizer.get_vocab_size()}"
    )

    cfg = model_config(args, tokenizer)
    model = LlamaForCausalLM(cfg)
    print(f"model: {sum(p.size for p in model.parameters()):,} parameters")
    result = train(model, train_tokens, heldout, train_eval, args)
    save_checkpoint(args.out, model, cfg, tokenizer)
    check = verify(args.out, heldout, prompts, args.max_new_tokens, model)
    summary = {
        "command": " ".join(["python", "examples/train_tiny.py", *(argv or sys.argv[1:])]),
        "args": {**vars(args), "out": display_path(args.out)},
        "python": platform.python_version(),
        "paddle": paddle.__version__,
        "corpus": "pydoc_data.topics",
        "corpus_sha256": corpus_sha256,
        "train_tokens": int(len(train_tokens)),
        "heldout_tokens": int(heldout.size),
        **result,
        "total_minutes": round((time.perf_counter() - started) / 60, 2),
        **check,
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"saved {args.out}: "
        + ", ".join(f"{f.name} {f.stat().st_size / 1e6:.2f} MB" for f in sorted(args.out.iterdir()))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

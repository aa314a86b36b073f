"""Tensor parallelism: the shards of every weight, the refusals, and 2 real processes under
``paddle.distributed.launch`` (gloo on CPU) giving TP=1's tokens with identical schedules
on both ranks (``--check-ranks``), and catching a planted divergence."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import paddle
import pytest

from paddle_step.config import ModelConfig
from paddle_step.distributed.tensor_parallel import TensorParallel, shard_config, shard_weights
from paddle_step.engine.arg_utils import build_engine
from paddle_step.entrypoints.openai.cli import parse_args as serve_parse_args
from paddle_step.layers import cpu_linear
from paddle_step.model_loader.loader import load_checkpoint
from paddle_step.sampling_params import SamplingParams
from paddle_step.testing.server_process import descendants, free_port, metric, wait_for_health
from paddle_step.testing.weight_formats import write_bfloat16_copy

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = REPO / "tests" / "data" / "hf-tiny"
LAUNCH_TIMEOUT_S = 120
# Two processes on a tight budget: 8 slots share a 16-block decoder pool (one full
# sequence), so requests are preempted and recovered.
TIGHT = (
    "--dtype", "float64", "--num-requests", "16", "--max-new-tokens", "16",
    "--max-batch", "8", "--block-size", "4", "--max-model-len", "64",
    "--kv-blocks", "80", "--decoder-pool-ratio", "0.2", "--ignore-eos", "--json",
)  # fmt: skip


def load_generate():
    spec = importlib.util.spec_from_file_location("generate", REPO / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tp1_token_ids(*args: str) -> list[list[int]]:
    """TP=1 in this process: the reference."""
    generate = load_generate()
    _, results, stats = generate.run(generate.parse_args(list(args)))
    assert stats.preemptions > 0, stats
    return [result.token_ids for result in results]


def launch(script: Path, *args: str, log_dir: Path) -> subprocess.CompletedProcess:
    """``script`` on 2 ranks under Paddle's launcher; what the user sees (its stdout,
    which carries rank 0's output) and its exit code."""
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
        "--master", f"127.0.0.1:{free_port()}", "--log_dir", str(log_dir),
        str(script), *args, "--tp", "2",
    ]  # fmt: skip
    # A new session: on timeout the launcher and both ranks are killed together.
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def launch_generate(tmp_path: Path, *args: str) -> dict:
    """generate.py on 2 ranks with --check-ranks: rank 0's one JSON object."""
    completed = launch(
        REPO / "examples" / "generate.py", *args, "--check-ranks", log_dir=tmp_path / "log"
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    # The launcher mixes rank 0's stderr and Paddle's own log lines into its stdout: the
    # result is its one JSON line; rank 1 prints none.
    (result,) = json_lines(completed.stdout)
    assert json_lines((tmp_path / "log" / "workerlog.1").read_text()) == []
    return result


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_tp2_greedy_equals_tp1_under_preemption(tmp_path, name):
    args = ("--model", str(CHECKPOINTS / name), *TIGHT)
    result = launch_generate(tmp_path, *args)
    assert result["stats"]["preemptions"] > 0 and result["stats"]["recoveries"] > 0
    assert [r["token_ids"] for r in result["requests"]] == tp1_token_ids(*args)


@pytest.mark.parametrize("flags", [("--dtype", "bfloat16"), ("--quantization", "int8")])
def test_tp2_packed_weights_keep_the_ranks_in_step(tmp_path, flags):
    # Each rank packs its own shard at load; --check-ranks compares every step.
    assert TIGHT[:2] == ("--dtype", "float64")
    args = ("--model", str(CHECKPOINTS / "qwen2-tiny"), *TIGHT[2:], *flags)
    result = launch_generate(tmp_path, *args)
    assert result["stats"]["preemptions"] > 0 and result["stats"]["recoveries"] > 0
    assert all(len(r["token_ids"]) == 16 for r in result["requests"])


def rank_slices(
    config: ModelConfig, local: ModelConfig, rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The full model's query columns, KV columns and intermediate columns that ``rank``'s
    shard (of config ``local``) holds."""
    head_dim = config.head_dim
    heads = np.arange(rank * local.num_heads * head_dim, (rank + 1) * local.num_heads * head_dim)
    first_kv = rank * local.num_heads // (config.num_heads // config.num_kv_heads)
    kv = np.arange(first_kv * head_dim, (first_kv + local.num_kv_heads) * head_dim)
    mlp = np.arange(rank * local.intermediate_size, (rank + 1) * local.intermediate_size)
    return heads, kv, mlp


class RankShare(NamedTuple):
    """What one rank's shard holds of the full model's products: columns of the fused
    q/k/v and gate/up products, rows of wo and w_down."""

    qkv_columns: np.ndarray
    gate_up_columns: np.ndarray
    o_rows: np.ndarray
    down_rows: np.ndarray


def rank_share(config: ModelConfig, local: ModelConfig, rank: int) -> RankShare:
    """``rank``'s share of a model of ``config``, whose shard has config ``local``."""
    head_dim, intermediate = config.head_dim, config.intermediate_size
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    heads = np.arange(rank * local.num_heads * head_dim, (rank + 1) * local.num_heads * head_dim)
    first_kv = rank * local.num_heads // (config.num_heads // config.num_kv_heads)
    kv = np.arange(first_kv * head_dim, (first_kv + local.num_kv_heads) * head_dim)
    mlp = np.arange(rank * local.intermediate_size, (rank + 1) * local.intermediate_size)
    return RankShare(
        qkv_columns=np.concatenate([heads, q_width + kv, q_width + kv_width + kv]),
        gate_up_columns=np.concatenate([mlp, intermediate + mlp]),
        o_rows=heads,
        down_rows=mlp,
    )


def packed_columns(product: cpu_linear.PackedWeights, ids: np.ndarray | None = None) -> np.ndarray:
    """Columns ``ids`` (default: all) of a packed product, [ids, K]."""
    ids = np.arange(product.n) if ids is None else ids
    return cpu_linear.columns(product, paddle.to_tensor(ids)).numpy()


def packed_products(layer) -> tuple[cpu_linear.PackedWeights, ...]:
    """A decoder layer's packed q/k/v, o, gate/up and down products."""
    qkv, _bias, o, gate_up, down = layer._dense_weights()
    return qkv.packed, o.packed, gate_up.packed, down.packed


@pytest.mark.parametrize(
    "checkpoint, quantization, world_size",
    [("llama-tiny", "int8", 2), ("llama-tiny", "int8", 4), ("qwen2-tiny bfloat16", None, 2)],
)
def test_shards_hold_the_full_models_packed_values(tmp_path, checkpoint, quantization, world_size):
    """Each rank's column-parallel q/k/v and gate/up shards hold exactly the full model's
    packed values: int8 is quantized per output column, so a column's scale does not depend
    on the others. bfloat16 shards, packed from a bfloat16 checkpoint's bits, also hold the
    full model's rows of wo and w_down exactly (int8 quantizes those over the rank's rows)."""
    name, *stored = checkpoint.split()
    path = CHECKPOINTS / name
    if stored:
        path = write_bfloat16_copy(path, tmp_path / name)
    full = load_checkpoint(path, quantization=quantization).model
    assert full.config.weight_format == (quantization or "bfloat16")
    for rank in range(world_size):
        tensor_parallel = TensorParallel(rank, world_size)
        shard = load_checkpoint(path, quantization=quantization, tensor_parallel=tensor_parallel)
        share = rank_share(full.config, shard.model.config, rank)
        for layer_full, layer_shard in zip(full.layers, shard.model.layers):
            f_qkv, f_o, f_gate_up, f_down = packed_products(layer_full)
            s_qkv, s_o, s_gate_up, s_down = packed_products(layer_shard)
            for whole, part, ids in ((f_qkv, s_qkv, share.qkv_columns),
                                     (f_gate_up, s_gate_up, share.gate_up_columns)):  # fmt: skip
                np.testing.assert_array_equal(packed_columns(part), packed_columns(whole, ids))
            if quantization is None:
                for whole, part, rows in ((f_o, s_o, share.o_rows),
                                          (f_down, s_down, share.down_rows)):  # fmt: skip
                    np.testing.assert_array_equal(
                        packed_columns(part), packed_columns(whole)[:, rows]
                    )


def test_tp2_sampling_equals_tp1(tmp_path):
    # --check-ranks compares both ranks' sampled tokens every step.
    args = ("--model", str(CHECKPOINTS / "qwen2-tiny"), *TIGHT, "--temperature", "0.8")
    args += ("--seed", "7")
    result = launch_generate(tmp_path, *args)
    assert [r["token_ids"] for r in result["requests"]] == tp1_token_ids(*args)


def test_tp2_prefix_caching_and_chunked_prefill_equal_tp1(tmp_path):
    """Both features on (prompts sharing a prefix, 24 tokens a step) under preemption: the
    ranks keep identical schedules and give the plain engine's tokens."""
    shared = ("--prompt", "The for statement iterates over the items", "--prompt",
              "The for statement iterates over a range", "--prompt",
              "The for statement iterates over the items of a list")  # fmt: skip
    args = ("--model", str(CHECKPOINTS / "llama-tiny"), *TIGHT, *shared, "--max-new-tokens", "19")
    result = launch_generate(tmp_path, *args, "--max-num-batched-tokens", "24")
    stats = result["stats"]
    assert stats["preemptions"] > 0 and stats["prompt_tokens_hit"] > 0
    plain = tp1_token_ids(*args, "--no-enable-prefix-caching")
    assert [r["token_ids"] for r in result["requests"]] == plain


def test_check_ranks_names_the_tensor_that_diverged(tmp_path):
    args = ("--model", str(CHECKPOINTS / "llama-tiny"), *TIGHT, "--check-ranks")
    completed = launch(
        REPO / "tests" / "distributed" / "tp_diverge.py", *args, log_dir=tmp_path / "log"
    )
    assert completed.returncode != 0
    message = (
        "--check-ranks: after step 3: tensor 'free_list' differs between rank 0 and rank(s) [1]"
    )
    assert message in completed.stdout
    assert json_lines(completed.stdout) == []


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_reassemble_to_the_full_weights(name, world_size):
    model = load_checkpoint(CHECKPOINTS / name, dtype="float64").model
    config = model.config
    full = {key: param.numpy() for key, param in model.named_parameters()}
    shards = [shard_weights(full, config, rank, world_size) for rank in range(world_size)]
    local = shard_config(config, world_size)
    assert local.num_heads == config.num_heads // world_size
    assert local.intermediate_size == config.intermediate_size // world_size
    kv_width = local.num_kv_heads * config.head_dim
    ranks_per_kv_head = max(1, world_size // config.num_kv_heads)
    for key, array in full.items():
        leaf = key.rsplit(".", 1)[-1]
        parts = [shard[key] for shard in shards]
        if leaf in ("wq", "q_bias", "w_gate", "w_up"):
            np.testing.assert_array_equal(np.concatenate(parts, axis=-1), array)
        elif leaf in ("wo", "w_down"):
            np.testing.assert_array_equal(np.concatenate(parts, axis=0), array)
        elif leaf in ("wk", "wv", "k_bias", "v_bias"):
            # Replicated KV heads (world_size 4 > 2 KV heads): each rank group holds one.
            distinct = parts[::ranks_per_kv_head]
            assert all(part.shape[-1] == kv_width for part in parts)
            np.testing.assert_array_equal(np.concatenate(distinct, axis=-1), array)
            for rank, part in enumerate(parts):
                np.testing.assert_array_equal(part, distinct[rank // ranks_per_kv_head])
        else:
            assert all(part is array for part in parts), key


def test_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match=r"--tp: expected a divisor of num_heads \(9\), got 2"):
        shard_config(ModelConfig(hidden_size=576, num_heads=9, num_kv_heads=3), 2)
    with pytest.raises(
        ValueError, match=r"--tp: expected a divisor or a multiple of num_kv_heads \(3\), got 2"
    ):
        shard_config(ModelConfig(hidden_size=72, num_heads=6, num_kv_heads=3), 2)


def test_tp_must_equal_the_launchers_world_size():
    env = {key: value for key, value in os.environ.items() if not key.startswith("PADDLE_")}
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "generate.py"), "--model", "random", "--tp", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert completed.returncode != 0
    assert "--tp: expected the launcher's world size (1;" in completed.stderr
    assert "got 2" in completed.stderr


def test_server_with_tp2_serves_tp1_text_and_frees_everything(tmp_path):
    """The server under the launcher on 2 ranks: rank 0 serves HTTP, both run an engine
    process, and rank 0's hands each batch of requests to the other. Greedy texts equal
    offline TP=1 on a budget under which the same requests preempt offline (whether the
    server preempts depends on when the requests arrive); aborted streams give their
    blocks back."""
    port = free_port()
    flags = ["--model", str(CHECKPOINTS / "llama-tiny"), "--dtype", "float64",
             "--max-batch", "4", "--block-size", "4", "--max-model-len", "64",
             "--kv-blocks", "30", "--decoder-pool-ratio", "0.3", "--port", str(port)]  # fmt: skip
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
        "--master", f"127.0.0.1:{free_port()}", "--log_dir", str(tmp_path),
        sys.executable, "-m", "paddle_step.serve", *flags, "--tp", "2", "--check-ranks",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # so the launcher and both ranks stop together
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, LAUNCH_TIMEOUT_S, functools.partial(_rank_logs, tmp_path))
        prompts = ["Hello there", "The engine", "a b c d e f", "paged attention", "x"]
        engine, loaded = build_engine(serve_parse_args(flags))
        ids = [loaded.tokenizer.encode(prompt) for prompt in prompts]
        expected = [
            loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            for result in engine.generate(ids, SamplingParams(max_tokens=20, eos_token_id=[]))
        ]
        assert engine.stats.preemptions > 0
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            cancelled = pool.submit(stream_and_close, url, "Once upon")
            texts = list(pool.map(lambda prompt: complete(url, prompt), prompts))
            cancelled.result()
        assert texts == expected
        deadline = time.monotonic() + 30
        while metric(url, "paddle_step_requests_running") + metric(
            url, "paddle_step_requests_waiting"
        ):
            assert time.monotonic() < deadline, "requests still held after the clients left"
            time.sleep(0.2)
        assert metric(url, "paddle_step_kv_free_blocks") == metric(
            url, "paddle_step_kv_total_blocks"
        )
        # --check-ranks found both ranks' states equal after every step.
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def complete(url: str, prompt: str) -> str:
    body = {"model": "llama-tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def stream_and_close(url: str, prompt: str) -> None:
    """A streaming request its client abandons after two chunks (an abort on every rank)."""
    body = {"model": "llama-tiny", "prompt": prompt, "max_tokens": 40, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for count, _line in enumerate(line for line in response.iter_lines() if line):
            if count >= 2:
                return


def _launch_server(tmp_path: Path, port: int, *flags: str) -> subprocess.Popen:
    """The shipped model served on 2 ranks under the launcher, in a session of its own."""
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
        "--master", f"127.0.0.1:{free_port()}", "--log_dir", str(tmp_path / "log"),
        sys.executable, "-m", "paddle_step.serve", "--tp", "2", "--port", str(port), *flags,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def _rank_logs(log_dir: Path) -> str:
    """The ends of the ranks' logs, for a server that did not start."""
    return "\n".join(
        f"{path.name}:\n{path.read_text(errors='replace')[-900:]}"
        for path in sorted(log_dir.glob("workerlog.*"))
    )


def _rank_process(launcher: int, rank: int) -> int:
    """The pid of the launcher's ``rank`` (its serve process)."""
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:
            continue
        if f"PADDLE_TRAINER_ID={rank}".encode() in variables and _is_serve(pid):
            return pid
    raise AssertionError(f"no rank {rank} under the launcher {launcher}")


def _is_serve(pid: int) -> bool:
    return b"paddle_step.serve" in _command_line(pid)


def _is_engine(pid: int) -> bool:
    return b"spawn_main" in _command_line(pid)


def _command_line(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


def _stream_ending(url: str, started: threading.Barrier) -> str:
    """How a long greedy stream ends: 'error' after an error event, 'finished', or 'cut'
    when the connection closes without either. Waits at ``started`` after its first
    chunk."""
    body = {"model": "pydoc-tiny", "prompt": "A list is", "max_tokens": 240, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    error = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for count, line in enumerate(response.iter_lines()):
                if count == 0:
                    started.wait(30)
                error |= line.startswith("data: ") and '"error"' in line
                if line == "data: [DONE]":
                    return "error" if error else "finished"
    except httpx.HTTPError:
        pass
    return "cut"


@contextlib.contextmanager
def _served_on_two_ranks(
    tmp_path: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen, str, list[int]]]:
    """The launcher, the server's URL once healthy, and every process under the launcher
    then; all killed at the end, orphans included."""
    port = free_port()
    process = _launch_server(tmp_path, port, *flags)
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        wait_for_health(
            url, process, LAUNCH_TIMEOUT_S, functools.partial(_rank_logs, tmp_path / "log")
        )
        pids = descendants(process.pid)
        yield process, url, pids
    finally:
        for pid in [process.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.wait(10)


def _wait_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.parametrize("killed", ["server", "engine"])
def test_tp2_server_ends_its_streams_with_an_error_when_a_rank_dies(tmp_path, killed):
    """Rank 1's server or engine killed mid-stream: its engine sees its server gone and
    exits (or is gone), rank 0's engine sees the collective fail, and every stream ends
    with an error event at once (they were cut off without one when the launcher killed
    rank 0 before its drain). The logs say so in a line each, without a traceback."""
    with _served_on_two_ranks(tmp_path) as (process, url, pids):
        started = threading.Barrier(4)
        with ThreadPoolExecutor(3) as pool:
            endings = [pool.submit(_stream_ending, url, started) for _ in range(3)]
            rank_1 = _rank_process(process.pid, 1)
            if killed == "engine":
                (rank_1,) = [pid for pid in descendants(rank_1) if _is_engine(pid)]
            started.wait(30)
            os.kill(rank_1, signal.SIGKILL)
            assert [ending.result(timeout=60) for ending in endings] == ["error"] * 3
        process.wait(60)
        _wait_gone(pids, "processes left after a rank died")
    logs = [(tmp_path / "log" / f"workerlog.{rank}").read_text() for rank in (0, 1)]
    assert "a tensor-parallel rank is gone" in logs[0]
    assert not any("Traceback" in log for log in logs), logs  # one line says what happened
    if killed == "engine":
        assert "rank 1: the engine process exited unexpectedly (killed by SIGKILL)" in logs[1]


def test_tp2_ranks_drain_then_stop_when_their_launcher_is_killed(tmp_path):
    """The launcher killed (SIGKILL) mid-stream: its ranks are supervised by nothing; rank
    0 drains its requests as on SIGTERM (rank 1 stays for the collectives), then both
    stop (they served on as orphans)."""
    with _served_on_two_ranks(tmp_path, "--shutdown-timeout", "60") as (process, url, pids):
        started = threading.Barrier(4)
        with ThreadPoolExecutor(3) as pool:
            endings = [pool.submit(_stream_ending, url, started) for _ in range(3)]
            started.wait(30)
            process.kill()
            process.wait(10)
            assert [ending.result(timeout=60) for ending in endings] == ["finished"] * 3
        _wait_gone(pids, "ranks still running after their launcher died")

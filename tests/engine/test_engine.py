"""Engine unit tests: config checks, allocator, admission, stops, slot reuse, invariants."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_step.config import EngineConfig, ModelConfig
from paddle_step.engine.block_allocator import EncoderBlockAllocator
from paddle_step.engine.llm_engine import Engine
from paddle_step.engine.slot_state import ShareInputs
from paddle_step.layers.sampler import sample_tokens
from paddle_step.models.llama import LlamaForCausalLM
from paddle_step.sampling_params import SamplingParams
from paddle_step.spec.check_state import check_state
from paddle_step.testing.greedy import greedy_reference
from paddle_step.testing.sampling import limited


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(dtype="float64", seed=11))


def assert_blocks_conserved(engine: Engine) -> None:
    """Decoder blocks are each in the pool or in one running slot's decoder columns; prompt
    blocks in slots' encoder columns are exactly those the host allocator handed out."""
    config, state = engine.config, engine.state
    pool = state.free_list.numpy()[: int(state.free_list_len.numpy()[0])].tolist()
    tables = state.block_tables.numpy()
    encoder_lens = state.encoder_block_lens.numpy()
    used = state.used_list_len.numpy()
    preempted = state.is_block_step.numpy()  # holds no decoder block, keeps used_list_len
    in_tables = tables[tables >= 0].tolist()
    assert len(set(in_tables)) == len(in_tables), f"a block is in two table cells: {tables}"
    decoder_owned, encoder_held = [], []
    for slot in range(config.max_batch):
        encoder_held += tables[slot, : encoder_lens[slot]].tolist()
        if not preempted[slot]:
            first = encoder_lens[slot]
            decoder_owned += tables[slot, first : first + used[slot]].tolist()
    assert sorted(pool + decoder_owned) == list(
        range(config.num_encoder_blocks, config.num_kv_blocks)
    ), f"pool {sorted(pool)} + decoder-owned {sorted(decoder_owned)}"
    assert sorted(encoder_held) == sorted(engine.encoder_blocks.allocated)
    assert sorted(in_tables) == sorted(encoder_held + decoder_owned)


def run_checked(engine: Engine) -> dict[int, list[int]]:
    """Steps to completion, checking the invariants after every step; tokens by request."""
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for result in engine.step():
            tokens[result.request_id] = result.token_ids
        assert_blocks_conserved(engine)
        check_state(engine.state.step_tensors(), engine.config.block_size)
    return tokens


# ---------------------------------------------------------------- config and state


# A valid config's sizes, which the two config tests vary.
SIZES = dict(max_batch=2, max_model_len=32, block_size=4, num_kv_blocks=64)


def test_config_derived_sizes() -> None:
    config = EngineConfig(**SIZES, decoder_pool_ratio=0.25, enc_dec_block_num=1)
    assert config.blocks_per_seq == 8 and config.max_dec_blocks == 8
    assert (config.num_decoder_blocks, config.num_encoder_blocks) == (16, 48)
    assert config.encoder_blocks_for(1) == 2
    assert config.encoder_blocks_for(9) == 4
    assert config.encoder_blocks_for(31) == 8  # capped at blocks_per_seq


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_batch=0), "max_batch: expected a positive int, got 0"),
        (dict(max_model_len=30), "max_model_len: expected a multiple of block_size"),
        (dict(num_kv_blocks=14), "decoder pool holds 7 blocks.*at least .* = 8"),
        (dict(decoder_pool_ratio=1.0), "decoder_pool_ratio: expected a float in \\(0, 1\\)"),
        (dict(decoder_pool_ratio="0.5"), "decoder_pool_ratio: expected a float in \\(0, 1\\)"),
        (dict(enc_dec_block_num=-1), "enc_dec_block_num: expected an int >= 0"),
        (dict(num_kv_blocks=20, decoder_pool_ratio=0.95), "encoder region holds 1 blocks"),
    ],
)
def test_config_rejects(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{**SIZES, **kwargs})


def test_share_inputs_start_empty_with_the_top_blocks_in_the_pool() -> None:
    config = EngineConfig(max_batch=3, max_model_len=16, block_size=4, num_kv_blocks=10)
    state = ShareInputs(config)
    assert state.free_list.numpy().tolist() == [9, 8, 7, 6, 5]
    assert state.free_list_len.numpy().tolist() == [5]
    assert state.stop_flags.numpy().all() and not state.is_block_step.numpy().any()
    assert (state.block_tables.numpy() == -1).all() and state.block_tables.shape == [3, 4]
    assert (state.pre_ids.numpy() == -1).all() and state.input_ids.shape == [3, 16]
    tensors = state.step_tensors()
    assert len(tensors) == 22 and tensors["step_idx"].dtype == paddle.int64
    check_state(tensors, config.block_size, decoder_blocks=range(5, 10))


def test_a_batch_past_the_memory_is_refused_naming_its_sizes(
    model: LlamaForCausalLM, monkeypatch
) -> None:
    """At once, before anything is allocated: a max_batch of 10^8 failed with a bare
    MemoryError (the scheduler's block list), and a server said only "out of memory"."""
    import paddle_step.host_memory as host_memory

    # What a machine of 16 GiB has.
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 16 * 2**30)
    huge = EngineConfig(max_batch=10**8, max_model_len=64, block_size=4, num_kv_blocks=64)
    named = r"slot state needs \d+\.\d GiB \(max_batch 100000000 slots x max_model_len 64 "
    with pytest.raises(MemoryError, match=named + r".*: a smaller --max-batch"):
        Engine(model, huge)
    blocks_for_all = EngineConfig(
        max_batch=10**8, max_model_len=64, block_size=4, num_kv_blocks=10**9
    )
    with pytest.raises(MemoryError, match=r"the KV cache needs .*--kv-blocks"):
        Engine(model, blocks_for_all)


def test_allocator_hands_each_block_out_once() -> None:
    allocator = EncoderBlockAllocator(5)
    first = allocator.allocate(3)
    assert first == [0, 1, 2]
    assert allocator.allocate(3) is None and allocator.num_free == 2  # nothing taken
    second = allocator.allocate(2)
    assert set(first).isdisjoint(second) and allocator.num_free == 0
    allocator.free(first[:2])
    with pytest.raises(ValueError, match="not allocated: \\[0\\]"):
        allocator.free([0])
    with pytest.raises(ValueError, match="distinct allocated"):
        allocator.free([2, 2])
    assert sorted(allocator.allocate(2) + second + [2]) == [0, 1, 2, 3, 4]
    assert allocator.allocated == frozenset(range(5))


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize("eos", [[259], [-1], list(range(9)), ["5"], [5.5], [True]])
def test_engine_eos_ids_outside_the_vocabulary_or_too_many_are_refused(
    model: LlamaForCausalLM, eos
) -> None:
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=10)
    with pytest.raises(ValueError, match="'eos_token_ids': expected at most 8 ids in \\[0, 259\\)"):
        Engine(model, config, eos_token_ids=eos)


def test_engine_takes_one_eos_id_as_an_int(model: LlamaForCausalLM) -> None:
    """A config.json's eos_token_id may be a bare int."""
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=10)
    assert Engine(model, config, eos_token_ids=np.int64(7)).eos_token_ids == (7,)


@pytest.mark.parametrize(
    "fields,message",
    [({"temperature": "1"}, "'temperature': expected a finite number >= 0, got '1'"),
     ({"temperature": float("inf")}, "'temperature': expected a finite number >= 0, got inf"),
     ({"top_p": float("nan")}, "'top_p': expected a value in \\(0, 1\\], got nan"),
     ({"min_p": None}, "'min_p': expected a value in \\[0, 1\\], got None"),
     ({"presence_penalty": True}, "'presence_penalty': expected a value in \\[-2, 2\\]"),
     ({"repetition_penalty": float("inf")}, "'repetition_penalty': expected a finite number > 0"),
     ({"logit_bias": {5: float("nan")}}, "'logit_bias': expected a map of token ids to finite"),
     ({"seed": -1}, "'seed': expected None or an int in \\[0, 2\\*\\*63\\), got -1"),
     ({"seed": 2**64}, "'seed': expected None or an int in \\[0, 2\\*\\*63\\)")],
)  # fmt: skip
def test_sampling_params_refuse_values_that_are_not_finite_numbers(fields, message) -> None:
    """A str, a bool, NaN or infinity is refused by name (a str used to fail on the
    comparison; NaN and infinity passed)."""
    with pytest.raises(ValueError, match=f"SamplingParams: argument {message}"):
        SamplingParams(**fields)


@pytest.mark.parametrize(
    "prompt,params,message",
    [([1, 2], {"max_tokens": 2}, "argument 'params': expected a SamplingParams, got dict"),
     ([1.5, 3], None, "expected int token ids, got float 1.5 at index 0"),
     (["5", 6], None, "expected int token ids, got str '5' at index 0"),
     ([True, 5], None, "expected int token ids, got bool True at index 0"),
     ("A list is", None, "expected a sequence of int token ids, got str 'A list is' \\(encode"),
     (7, None, "expected a sequence of int token ids, got int 7")],
)  # fmt: skip
def test_add_request_refuses_what_is_not_token_ids_or_params(
    model: LlamaForCausalLM, prompt, params, message
) -> None:
    engine = Engine(
        model, EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=10)
    )
    with pytest.raises(TypeError, match=message):
        engine.add_request(prompt, params)
    assert engine.add_request(np.array([1, 2]), limited(2)) == 0  # NumPy ints are ints


def test_engine_names_an_argument_of_the_wrong_kind(model: LlamaForCausalLM) -> None:
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=10)
    with pytest.raises(
        TypeError, match="argument 'model': expected a LlamaForCausalLM .*got NoneType"
    ):
        Engine(None, config)
    with pytest.raises(TypeError, match="argument 'config': expected an EngineConfig, got dict"):
        Engine(model, {"max_batch": 2})


def test_add_request_rejects_requests_that_cannot_run(model: LlamaForCausalLM) -> None:
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=10)
    engine = Engine(model, config)
    with pytest.raises(ValueError, match="expected at least one token"):
        engine.add_request([], limited(4))
    with pytest.raises(ValueError, match="expected token ids in \\[0, 259\\), got \\[300\\]"):
        engine.add_request([1, 300], limited(4))
    with pytest.raises(ValueError, match="= 17, expected <= max_model_len \\(16\\)"):
        engine.add_request([1] * 9, limited(8))
    with pytest.raises(ValueError, match="max_tokens': expected an int >= 0, got -1"):
        engine.add_request([1], limited(-1))
    with pytest.raises(ValueError, match="top_p': expected a value in \\(0, 1\\]"):
        engine.add_request([1], limited(2, top_p=0.0))
    with pytest.raises(ValueError, match="stop_token_ids': expected token ids in \\[0, 259\\)"):
        engine.add_request([1], limited(2, stop_token_ids=[259]))
    with pytest.raises(ValueError, match="prompt length 16 \\+ max_tokens 0 \\(1 sampled\\) = 17"):
        engine.add_request([1] * 16, limited(0, prompt_logprobs=0))
    small = Engine(
        model,
        EngineConfig(
            max_batch=2, max_model_len=32, block_size=4, num_kv_blocks=20, decoder_pool_ratio=0.7
        ),
    )
    with pytest.raises(ValueError, match="needs 7 encoder blocks, expected <= 6"):
        small.add_request([1] * 21, limited(4))
    assert engine.num_waiting == 0 and not engine.has_unfinished()


def test_admission_waits_for_a_free_slot_and_reuses_it(model: LlamaForCausalLM) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18]]
    limits = [2, 7, 4]
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16)
    engine = Engine(model, config)
    ids = [engine.add_request(prompt, limited(limit)) for prompt, limit in zip(prompts, limits)]
    assert ids == [0, 1, 2] and engine.num_waiting == 3

    assert engine.step() == []  # prefill of requests 0 and 1; request 2 has no slot
    assert (engine.num_active, engine.num_waiting) == (2, 1)
    finished = engine.step()  # request 0 reaches its 2 tokens and leaves slot 0
    assert [result.request_id for result in finished] == [0]
    assert (engine.num_active, engine.num_waiting) == (1, 1)
    assert (engine.state.block_tables.numpy()[0] == -1).all()

    engine.step()  # request 2 takes the freed slot 0
    assert (engine.num_active, engine.num_waiting) == (2, 0)
    assert int(engine.state.ori_seq_lens_encoder.numpy()[0]) == len(prompts[2])
    tokens = run_checked(engine)
    tokens[0] = finished[0].token_ids
    assert [tokens[i] for i in ids] == greedy_reference(model, prompts, limits)


def test_admission_waits_for_encoder_blocks(model: LlamaForCausalLM) -> None:
    # The encoder region (8 blocks) holds two 9..12-token prompts (3 + 1 blocks each), so
    # the third request waits although slots are free.
    prompts = [list(range(20, 30)), list(range(40, 49)), list(range(60, 72))]
    config = EngineConfig(max_batch=4, max_model_len=32, block_size=4, num_kv_blocks=16)
    assert config.num_encoder_blocks == 8
    engine = Engine(model, config)
    for prompt in prompts:
        engine.add_request(prompt, limited(6))
    engine.step()
    assert (engine.num_active, engine.num_waiting) == (2, 1)
    assert engine.encoder_blocks.num_free == 0
    tokens = run_checked(engine)
    assert [tokens[i] for i in range(3)] == greedy_reference(model, prompts, 6)


def test_eos_and_length_stops(model: LlamaForCausalLM) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = greedy_reference(model, [prompt], 12)[0]
    eos = greedy[3]
    first_eos = greedy.index(eos)
    config = EngineConfig(max_batch=2, max_model_len=24, block_size=4, num_kv_blocks=24)
    engine = Engine(model, config, check_state=True)
    with_eos = engine.generate([prompt, prompt], limited(12, eos_token_id=eos))
    for result in with_eos:
        assert (result.finish_reason, result.token_ids) == ("eos", greedy[: first_eos + 1])

    without_eos = engine.generate([prompt], limited(12))[0]  # no tokenizer: no default eos
    assert (without_eos.finish_reason, without_eos.token_ids) == ("length", greedy)
    assert without_eos.prompt_ids == prompt

    at_model_len = engine.generate([prompt], limited(24 - len(prompt)))[0]
    assert at_model_len.finish_reason == "length" and len(at_model_len.token_ids) == 16


def test_state_is_released_when_everything_finishes(model: LlamaForCausalLM) -> None:
    config = EngineConfig(max_batch=3, max_model_len=24, block_size=4, num_kv_blocks=24)
    engine = Engine(model, config)
    engine.generate([[1, 2, 3], [4] * 10, [7, 8]], limited([9, 3, 14]))
    state = engine.state
    assert engine.encoder_blocks.num_free == config.num_encoder_blocks
    assert int(state.free_list_len.numpy()[0]) == config.num_decoder_blocks
    assert sorted(state.free_list.numpy().tolist()) == list(range(12, 24))
    assert (state.block_tables.numpy() == -1).all()
    assert state.stop_flags.numpy().all() and not state.decode_active.numpy().any()
    assert engine.stats.generated_tokens == 26 and engine.stats.steps >= 14


def test_invariants_hold_every_step_under_preemption(model: LlamaForCausalLM) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 12))).tolist() for _ in range(10)]
    limits = [int(rng.integers(8, 20)) for _ in prompts]
    # Pool of 8 blocks = one full sequence; 6 slots decoding at once must share it.
    config = EngineConfig(
        max_batch=6, max_model_len=32, block_size=4, num_kv_blocks=40, decoder_pool_ratio=0.2
    )
    engine = Engine(model, config, check_state=True)
    for prompt, limit in zip(prompts, limits):
        engine.add_request(prompt, limited(limit))
    tokens = run_checked(engine)
    assert engine.stats.preemptions > 0 and engine.stats.recoveries > 0
    assert engine.stats.preemptions == engine.stats.recoveries
    assert engine.stats.peak_blocks_in_use <= config.num_kv_blocks
    assert [tokens[i] for i in range(len(prompts))] == greedy_reference(model, prompts, limits)


def test_no_progress_raises_instead_of_looping(model: LlamaForCausalLM) -> None:
    config = EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16)
    engine = Engine(model, config)
    leaked = engine.encoder_blocks.allocate(config.num_encoder_blocks)  # simulate a leak
    assert leaked is not None
    engine.add_request([1, 2, 3], limited(4))
    with pytest.raises(RuntimeError, match="no progress.*1 request\\(s\\) waiting.*0 of 8 free"):
        engine.step()


def test_sampler_greedy_and_nucleus() -> None:
    logits = paddle.to_tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], dtype="float64")
    greedy = paddle.zeros([2], dtype="float32")
    assert sample_tokens(logits, greedy, paddle.ones([2]), None).tolist() == [1, 0]
    hot = paddle.full([2], 1.0, dtype="float32")
    # A tiny nucleus keeps only the most likely token, whatever the draw.
    tiny = paddle.full([2], 1e-6, dtype="float32")
    for draw in (0.0, 0.5, 0.999999):
        uniforms = paddle.full([2], draw, dtype="float64")
        assert sample_tokens(logits, hot, tiny, uniforms).tolist() == [1, 0]
    # Without a cut, draws walk the tokens in id order: 0, 1, 2, 3.
    probs = paddle.nn.functional.softmax(logits[:1], axis=-1).numpy()[0]
    edges = np.cumsum(probs)
    for draw, expected in zip((0.0, edges[0] + 1e-9, edges[1] + 1e-9, 0.999999), (0, 1, 2, 3)):
        uniforms = paddle.full([1], draw, dtype="float64")
        token = sample_tokens(logits[:1], hot[:1], paddle.ones([1]), uniforms)
        assert token.tolist() == [expected]


def test_share_inputs_check_reports_a_planted_corruption():
    from paddle_step import StateError
    from paddle_step.config import EngineConfig
    from paddle_step.engine.slot_state import ShareInputs

    state = ShareInputs(EngineConfig(max_batch=2, max_model_len=16, block_size=4, num_kv_blocks=16))
    state.check()  # a fresh state is valid
    pool_top = int(state.free_list[0])
    state.block_tables[1, 0] = pool_top  # a pool block also owned by slot 1
    with pytest.raises(StateError, match=f"block {pool_top}"):
        state.check()


# ---------------------------------------------------------------- serving hooks


def test_eos_list_and_ignore_eos(model: LlamaForCausalLM) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = greedy_reference(model, [prompt], 12)[0]
    stops = [greedy[5], greedy[2]]  # either ends the request: the earlier one does
    first = min(greedy.index(token) for token in stops)
    config = EngineConfig(max_batch=2, max_model_len=24, block_size=4, num_kv_blocks=24)
    engine = Engine(model, config, eos_token_ids=stops)
    [result] = engine.generate([prompt], limited(12))
    assert (result.finish_reason, result.token_ids) == ("eos", greedy[: first + 1])
    [ignored] = engine.generate([prompt], limited(12, eos_token_id=[]))
    assert (ignored.finish_reason, ignored.token_ids) == ("length", greedy)
    with pytest.raises(ValueError, match="'eos_token_id': expected None, an id or at most 8"):
        engine.add_request(prompt, limited(4, eos_token_id=list(range(9))))


def test_last_step_outputs_stream_every_token(model: LlamaForCausalLM) -> None:
    config = EngineConfig(
        max_batch=6, max_model_len=32, block_size=4, num_kv_blocks=40, decoder_pool_ratio=0.2
    )
    engine = Engine(model, config)
    prompts = [[1, 2, 3], [4] * 9, [7, 8], [9, 9, 9, 9], [5], [6, 6], [8] * 5]
    ids = [engine.add_request(prompt, limited(20)) for prompt in prompts]
    streamed: dict[int, list[int]] = {request_id: [] for request_id in ids}
    finished = {}
    while engine.has_unfinished():
        for result in engine.step():
            finished[result.request_id] = result.token_ids
        for token in engine.last_step_outputs:
            streamed[token.request_id].append(token.token_id)
    assert engine.stats.preemptions > 0  # a preempted request's stream goes on unbroken
    assert streamed == finished


def run_to_end(engine: Engine) -> dict[int, list[int]]:
    tokens = {}
    while engine.has_unfinished():
        tokens.update((result.request_id, result.token_ids) for result in engine.step())
    return tokens


def test_seeded_request_samples_the_same_whatever_its_arrival(model: LlamaForCausalLM) -> None:
    config = EngineConfig(max_batch=4, max_model_len=32, block_size=4, num_kv_blocks=64)
    prompt = [5, 6, 7]
    alone = Engine(model, config)
    alone_id = alone.add_request(prompt, limited(12, temperature=0.9, seed=1234))
    busy = Engine(model, config, seed=99)  # another engine seed, other requests first
    for other in ([1], [2, 2], [3, 3, 3]):
        busy.add_request(other, limited(5, temperature=0.9))
    busy_id = busy.add_request(prompt, limited(12, temperature=0.9, seed=1234))
    assert run_to_end(busy)[busy_id] == run_to_end(alone)[alone_id]


@pytest.mark.parametrize("when", ["waiting", "after-prefill", "decoding", "preempted"])
def test_abort_frees_slot_and_blocks(model: LlamaForCausalLM, when: str) -> None:
    config = EngineConfig(
        max_batch=6, max_model_len=32, block_size=4, num_kv_blocks=40, decoder_pool_ratio=0.2
    )
    engine = Engine(model, config, check_state=True)
    prompts = [[1, 2, 3, 4, 5], [6] * 9, [7, 8], [9, 10, 11], [12, 13], [5], [6, 6], [8] * 5]
    ids = [engine.add_request(prompt, limited(20)) for prompt in prompts]
    victim = ids[-1]
    if when != "waiting":
        victim = ids[1]
        steps = {"after-prefill": 1, "decoding": 3}.get(when)
        if steps is None:  # run until some request is preempted; abort that one
            for _ in range(100):  # bounded: this budget preempts within a few steps
                if engine.num_preempted:
                    break
                engine.step()
            assert engine.num_preempted, "no request was preempted in 100 steps"
            slot = int(np.flatnonzero(engine.scheduler.live & engine.scheduler.preempted)[0])
            victim = int(engine.scheduler.slot_request_ids[slot])
        else:
            for _ in range(steps):
                engine.step()
    assert engine.abort(victim)
    assert not engine.abort(victim)  # once
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r) for r in engine.step())
        assert_blocks_conserved(engine)
    if when == "waiting":
        assert victim not in results  # it just left the queue
    else:  # retired like any finished request, its tokens so far those of a full decode
        assert results[victim].finish_reason == "abort"
        tokens = results[victim].token_ids
        assert len(tokens) < 20
        assert greedy_reference(model, [prompts[ids.index(victim)]], 20)[0][: len(tokens)] == tokens
    others = [request_id for request_id in ids if request_id != victim]
    expected = greedy_reference(model, [prompts[ids.index(i)] for i in others], 20)
    assert [results[i].token_ids for i in others] == expected
    assert engine.num_active == 0 and engine.encoder_blocks.num_free == config.num_encoder_blocks
    assert engine.free_decoder_blocks == config.num_decoder_blocks
    assert int(engine.state.step_lens.numpy()[0]) == 0
    assert not engine.abort(12345)

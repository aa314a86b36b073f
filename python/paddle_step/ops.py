"""The two ops, as Python functions.

In dynamic mode they call the pybind11 binding of the C++ entry point (about
1 us of dispatch); in static mode (inside ``paddle.jit.to_static``) they run
the same C++ input checks on the variables' dtypes and shapes, then add the
registered ``static_op_*`` op to the program. Both run the same kernels.
"""

from __future__ import annotations

import numbers

import paddle

import paddle_step_ops as _library

from .spec.tensor_table import STEP_PADDLE_OUTPUTS, STEP_PADDLE_TENSORS

_in_dynamic_mode = paddle.in_dynamic_mode


def _describe(tensors):
    """(dtype, shape) of static-mode variables, for the C++ checks."""
    return [(str(tensor.dtype), list(tensor.shape)) for tensor in tensors]


def _argument_type_error(op, names, arguments, error):
    """The TypeError of a call pybind11 refused: the first argument of the wrong kind by
    name (pybind11's own message lists every signature and dumps the tensors); ``error``
    itself when every argument has its kind. ``arguments``: the op function's locals, whose
    parameters ``names`` lists. Only on the failure path: the call itself stays one
    pybind11 dispatch."""
    for name in names:
        value = arguments[name]
        if name in ("block_size", "encoder_decoder_block_num", "num_seqs", "num_queries"):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                return TypeError(f"{op}: argument '{name}': expected an int, got "
                                 f"{type(value).__name__}")  # fmt: skip
            if not -(2**63) <= value < 2**63:
                return ValueError(f"{op}: argument '{name}': expected an int64, got {value}")
        elif not isinstance(value, paddle.Tensor) and not (name == "active" and value is None):
            expected = "a paddle.Tensor or None" if name == "active" else "a paddle.Tensor"
            return TypeError(f"{op}: argument '{name}': expected {expected}, got "
                             f"{type(value).__name__}")  # fmt: skip
    return error


def _write_back(targets, results):
    # In a static program an in-place op yields new values; assigning them to
    # the input variables makes the update visible to the caller, as in
    # dynamic mode.
    for target, result in zip(targets, results):
        # Integer bookkeeping has no gradient; paddle 2.6 would otherwise try
        # to build a backward pass for the op.
        result.stop_gradient = True
        paddle.assign(result, output=target)


# The ops' parameters, in their signatures' order (the first of the wrong kind is named).
_STEP_PADDLE_ARGUMENTS = (*STEP_PADDLE_TENSORS, "block_size", "encoder_decoder_block_num")
_ADVANCE_STEP_ARGUMENTS = ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens",
                           "slot_mapping", "block_tables", "num_seqs", "num_queries",
                           "block_size", "active")  # fmt: skip

# The ops' argument lists stay packed (fmt: off): one name per line would spread each op's
# three lists of the same names over 80 lines.


# fmt: off
def step_paddle(stop_flags, seq_lens_this_time, ori_seq_lens_encoder, seq_lens_encoder,
                seq_lens_decoder, block_tables, encoder_block_lens, is_block_step,
                step_block_list, step_lens, recover_block_list, recover_lens, need_block_list,
                need_block_len, used_list_len, free_list, free_list_len, input_ids, pre_ids,
                step_idx, next_tokens, first_token_ids, block_size, encoder_decoder_block_num):
    """One KV-block scheduling step, in place (docs/SPEC.md, step_paddle).

    Arguments are FastDeploy's, in FastDeploy's order. Returns None.
    """
    if _in_dynamic_mode():
        # The arguments passed as they came: no tuple on the hot path.
        try:
            _library.step_paddle(
                stop_flags, seq_lens_this_time, ori_seq_lens_encoder, seq_lens_encoder,
                seq_lens_decoder, block_tables, encoder_block_lens, is_block_step,
                step_block_list, step_lens, recover_block_list, recover_lens, need_block_list,
                need_block_len, used_list_len, free_list, free_list_len, input_ids, pre_ids,
                step_idx, next_tokens, first_token_ids, block_size, encoder_decoder_block_num)
        except (TypeError, RuntimeError) as error:  # pybind11's: no overload, no cast
            raise _argument_type_error(
                "paddle_step.step_paddle", _STEP_PADDLE_ARGUMENTS, locals(), error) from None
        return None
    tensors = (stop_flags, seq_lens_this_time, ori_seq_lens_encoder, seq_lens_encoder,
               seq_lens_decoder, block_tables, encoder_block_lens, is_block_step,
               step_block_list, step_lens, recover_block_list, recover_lens, need_block_list,
               need_block_len, used_list_len, free_list, free_list_len, input_ids, pre_ids,
               step_idx, next_tokens, first_token_ids)
    # fmt: on
    _library.check_step_paddle(_describe(tensors), int(block_size))
    results = _library.static_op_step_paddle(
        *tensors, int(block_size), int(encoder_decoder_block_num)
    )
    by_name = dict(zip(STEP_PADDLE_TENSORS, tensors))
    _write_back([by_name[name] for name in STEP_PADDLE_OUTPUTS], results)
    return None


# fmt: off
def advance_step(input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
                 block_tables, num_seqs, num_queries, block_size, *, active=None):
    """Advances the next decode inputs in place (docs/SPEC.md, advance_step).

    Rows ``i < num_queries`` with ``active[i]`` (when given) get the sampled
    token, their position, ``seq_lens + 1`` and their KV slot; the other rows
    are padding (token 0, position 0, slot -1). Returns None.
    """
    if _in_dynamic_mode():
        try:
            _library.advance_step(input_tokens, sampled_token_ids, input_positions, seq_lens,
                                  slot_mapping, block_tables, active, num_seqs, num_queries,
                                  block_size)
        except (TypeError, RuntimeError) as error:  # pybind11's: no overload, no cast
            raise _argument_type_error(
                "paddle_step.advance_step", _ADVANCE_STEP_ARGUMENTS, locals(), error) from None
        return None
    tensors = (input_tokens, sampled_token_ids, input_positions, seq_lens, slot_mapping,
               block_tables)
    # fmt: on
    described = _describe(tensors if active is None else tensors + (active,))
    _library.check_advance_step(described, int(num_seqs), int(num_queries), int(block_size))
    results = _library.static_op_advance_step(
        *tensors, active, int(num_seqs), int(num_queries), int(block_size)
    )
    _write_back((input_tokens, input_positions, seq_lens, slot_mapping), results)
    return None

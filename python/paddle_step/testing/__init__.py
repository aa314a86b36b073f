"""Test support that tests, benchmarks and the Paddle-free GPU harness share.

- ``ref_step_paddle``, ``ref_advance_step``: sequential NumPy references of the ops
  (docs/SPEC.md);
- ``fake_decode_loop``: a FastDeploy-like serving loop on NumPy arrays that drives
  ``step_paddle`` and checks its work as a model would feel it;
- ``step_paddle_cases``, ``advance_step_cases``: the op test cases, run by any build
  through a ``run_op`` callable;
- ``paddle_ops``: the compiled ops as such callables (the only module here that needs
  paddle; nothing imports it implicitly);
- ``server_process``: the server in a subprocess on 127.0.0.1 (standard library only);
- ``sampling``: the ``limited`` SamplingParams shorthand of the engine tests.
"""

"""SPEC's tables and invariants in NumPy: the step_paddle tensor table and ``check_state``.
No paddle."""

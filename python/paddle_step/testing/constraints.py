"""Constraints for tests: a small ``TokenConstraint`` (the token at step i must come from
the i-th of a cycle of allowed sets, finished after ``length`` tokens) and the JSON schema
the structured-output tests constrain to. NumPy only."""

from __future__ import annotations

import numpy as np

__all__ = ["OBJECT_SCHEMA", "CyclingConstraint"]

# An object with every kind of value a JSON schema constrains (a bounded string, an enum,
# a bounded integer, an optional bounded array of booleans): any valid output is under
# 110 characters of compact JSON, so a sampled answer fits a small token budget.
OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["list", "dict", "tuple"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "kind", "size"],
    "additionalProperties": False,
}


class CyclingConstraint:
    """Allows ``allowed[i % len(allowed)]`` at the i-th token; finished after ``length``.

    ``accepted`` records the tokens it was told about, so tests can check that the
    engine reports every sampled token once, in order."""

    def __init__(self, allowed: list[list[int]], length: int) -> None:
        self.allowed = allowed
        self.length = length
        self.accepted: list[int] = []

    def allowed_tokens(self, vocab_size: int) -> np.ndarray | None:
        mask = np.zeros(vocab_size, dtype=bool)
        mask[self.allowed[len(self.accepted) % len(self.allowed)]] = True
        return mask

    def accept_token(self, token_id: int) -> None:
        expected = self.allowed[len(self.accepted) % len(self.allowed)]
        if token_id not in expected:
            raise AssertionError(f"token {token_id} is not among the allowed {expected}")
        self.accepted.append(token_id)

    def is_finished(self) -> bool:
        return len(self.accepted) >= self.length

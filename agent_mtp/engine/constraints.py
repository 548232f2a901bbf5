"""The protocol a token-level constraint (a grammar matcher) implements so the decode loop can respect it.

The decode loop (``engine/decode.py``) uses a constraint like this, per pass:

* position 1 (the NTP token) is chosen from the logits masked by :meth:`TokenConstraint.allowed_mask`, so the
  output is valid from the first token;
* positions 2..k (mask predictions or drafts) are offered one by one to :meth:`TokenConstraint.accept`; the block
  is cut at the first token the constraint rejects, and ConfAdapt / verified acceptance applies to the valid prefix;
* tokens that were offered but not kept are undone with :meth:`TokenConstraint.rollback`;
* after each pass, :meth:`TokenConstraint.forced_tokens` may return tokens that are the only valid continuation
  (jump-forward); they are appended without a forward pass.

An implementation backed by xgrammar lives in ``agent_mtp/engine/grammar.py``. It also has an optional
``allows(token_id) -> bool`` (``allowed_mask(V)[token_id]`` without building the mask), which the decode loop uses,
when present, to check the greedy token of a pass before it falls back to the mask.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenConstraint(Protocol):
    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """Bool tensor [vocab_size]: True where the next token is allowed in the current state."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; return False (state unchanged) when the token is not allowed."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True when the constrained output is complete (generation must stop)."""
        ...

    def forced_tokens(self) -> list[int]:
        """Tokens that are the only valid continuation from here (may be empty). Does not advance the state."""
        ...

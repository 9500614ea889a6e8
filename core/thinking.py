"""A reasoning model's thinking in an output: where it is, and its token budget.

`SamplingParams.reasoning` marks the thinking (`ReasoningGate`): an output starts in it
when its prompt opened it, or opens it with the start token as its first token, and leaves
it with the first end token. `follow_thinking` keeps `Sequence.thinking` and
`Sequence.num_thinking_tokens` up to date as tokens land; `apply_thinking_budgets` leaves
only the end token to a row whose thinking holds ``thinking_token_budget`` tokens, so the
answer still comes within ``max_tokens`` (vLLM's ``thinking_token_budget``, llama.cpp's
reasoning budget).
"""

from __future__ import annotations

import torch

from heron.core.sequence import Sequence


def follow_thinking(seq: Sequence, token_id: int) -> bool:
    """Note ``token_id``, just appended to ``seq``'s output. True when it belongs to the
    thinking (its start and end tokens included), which a grammar does not see."""
    gate = seq.params.reasoning
    if gate is None:
        return False
    if seq.num_output_tokens == 1 and token_id == gate.start_token_id:
        seq.thinking = True  # opens it, or repeats the prompt's opening
        return True
    if seq.thinking:
        seq.thinking = token_id != gate.end_token_id
        seq.num_thinking_tokens += seq.thinking
        return True
    return False


def budget_spent(seq: Sequence) -> bool:
    """Whether ``seq``'s next token must end its thinking."""
    budget = seq.params.thinking_token_budget
    return seq.thinking and budget is not None and seq.num_thinking_tokens >= budget


def apply_thinking_budgets(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Leave only the end token (at logit 0) to each row whose thinking spent its budget;
    in place. Last of the logit edits: the budget outranks bans and grammars."""
    for i, seq in enumerate(seqs):
        if budget_spent(seq):  # once per output at most: a loop costs nothing
            logits[i].fill_(float("-inf"))
            logits[i, seq.params.reasoning.end_token_id] = 0.0

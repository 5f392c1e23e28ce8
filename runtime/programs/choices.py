"""How `select` turns the model's token logprobs for each choice into one pick.

Every method sees, for each choice, the logprob of each of its tokens given the prompt
(`conditional`) and, when it asks for them, given no context at all (`unconditional`).

- `token_length_normalized` (the default): the highest mean token logprob. Longer choices are
  not penalised for having more tokens.
- `greedy_token_selection`: compare choices token by token, as greedy decoding would: the best
  first token wins, ties go to the next token. A choice that has run out of tokens continues
  with its own mean, so a prefix of another choice competes fairly.
- `unconditional_likelihood_normalized`: the highest mean of (conditional - unconditional)
  token logprob: how much the prompt raises the choice's likelihood over its prior, which
  corrects for choices that are likely anywhere (common words, short answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ChoiceScores:
    conditional: list[list[float]]  # per choice, per token
    unconditional: list[list[float]] | None = None


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    scores: list[float]  # the method's score per choice (higher is better)


class ChoicesMethod:
    name = "base"
    needs_unconditional = False

    def __call__(self, scores: ChoiceScores) -> ChoiceResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"rl.{self.name}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # first of equals


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def __call__(self, scores: ChoiceScores) -> ChoiceResult:
        means = [_mean(lp) for lp in scores.conditional]
        return ChoiceResult(_argmax(means), means)


class GreedyTokenSelection(ChoicesMethod):
    name = "greedy_token_selection"

    def __call__(self, scores: ChoiceScores) -> ChoiceResult:
        width = max(len(lp) for lp in scores.conditional)
        padded = [list(lp) + [_mean(lp)] * (width - len(lp)) for lp in scores.conditional]
        candidates = list(range(len(padded)))
        for position in range(width):
            best = max(padded[i][position] for i in candidates)
            candidates = [i for i in candidates if padded[i][position] == best]
            if len(candidates) == 1:
                break
        # Scores: the first-token logprob, which decides unless there is a tie.
        return ChoiceResult(candidates[0], [lp[0] for lp in padded])


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def __call__(self, scores: ChoiceScores) -> ChoiceResult:
        if scores.unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        gains = [_mean([c - u for c, u in zip(cond, uncond)])
                 for cond, uncond in zip(scores.conditional, scores.unconditional)]
        return ChoiceResult(_argmax(gains), gains)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

def document_start(bos: int | None, eos: Sequence[int | None]) -> int:
    """The token choices are scored after "without context": a document start, BOS, or EOS
    for models trained with EOS between documents and no BOS (GPT-2 style, SmolLM2)."""
    start = bos if bos is not None else next((e for e in eos if e is not None), None)
    if start is None:
        raise ValueError("choices_method: the model has neither BOS nor EOS to score choices "
                         "without context")
    return start


# The methods a segment executed by the runtime can name (a program's own method runs in the
# program, outside segments).
METHODS: dict[str, ChoicesMethod] = {m.name: m for m in (
    token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)}

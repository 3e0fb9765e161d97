"""The demo's learning problem: copy a short digit string, rewarded by a rule.

A prompt is a few digits ("3 1 0"); the right response is the same digits followed by the
end-of-sequence token. The reward is the fraction of the expected response (digits and end
token) produced at the right position: a fresh policy earns about 0.1, a perfect one 1.0.
Prompts draw their digits from a small alphabet (0-3 by default) while the policy may emit
any of the 13 tokens, so it has to learn both which tokens are digits of the task and which
digit goes where. That is learnable by a two-layer policy of a few thousand parameters in a
few dozen GRPO steps on a CPU (with all ten digits, reinforcement learning needs many times
more samples before the copying starts). Every response has several tokens, so generation
can be interrupted mid-response and continued later (partial rollouts), and every token
passes the mixture-of-experts layers (R3 routes).

Token ids: the digits 0-9 are ids 0-9, then ``EOS`` (10), ``BOS`` (11) and ``SEP`` (12). A
prompt encodes as ``[BOS, d1, ..., dk, SEP]``. A digit token's text is the digit with a
leading space (so the texts of successive generation segments concatenate correctly) and
special tokens have no text, as serving engines do with ``skip_special_tokens``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..sample import Sample

__all__ = [
    "BOS",
    "DIGITS",
    "EOS",
    "SEP",
    "VOCAB_SIZE",
    "CopyTask",
    "decode",
    "encode_prompt",
    "piece",
    "reward",
    "sample_reward",
    "target_tokens",
    "token_name",
]

DIGITS = 10
EOS = 10
BOS = 11
SEP = 12
VOCAB_SIZE = 13


def encode_prompt(text: str) -> list[int]:
    """Token ids of a prompt text such as ``"3 1 4"``: ``[BOS, 3, 1, 4, SEP]``."""
    digits = text.split()
    if not digits or any(len(d) != 1 or not d.isdigit() or not d.isascii() for d in digits):
        raise ValueError(f"A demo prompt is digits separated by spaces, got {text!r}")
    return [BOS, *(int(d) for d in digits), SEP]


def piece(token: int) -> str:
    """The text of one token: a digit with a leading space (so pieces concatenate), specials empty."""
    return f" {token}" if 0 <= token < DIGITS else ""


def token_name(token: int) -> str:
    """A printable name of one token (``"3"``, ``"<eos>"``), for log-prob listings."""
    names = {EOS: "<eos>", BOS: "<bos>", SEP: "<sep>"}
    return str(token) if 0 <= token < DIGITS else names.get(token, f"<{token}>")


def decode(tokens: Sequence[int]) -> str:
    """Text of response tokens: digits separated by spaces; special tokens render as nothing."""
    return "".join(piece(t) for t in tokens).strip()


def target_tokens(label: str) -> list[int]:
    """The expected response for a label (the prompt's digits): the digits, then ``EOS``."""
    return [*encode_prompt(label)[1:-1], EOS]


def reward(response_tokens: Sequence[int], label: str) -> float:
    """Fraction of the expected response produced at the right position (0.0 to 1.0)."""
    target = target_tokens(label)
    hits = sum(1 for got, want in zip(response_tokens, target, strict=False) if got == want)
    return hits / len(target)


def sample_reward(sample: Sample) -> float:
    """The rule reward of a sample's response (its label is the prompt's digits)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :] if sample.response_length else []
    return reward(response, str(sample.label))


@dataclass(frozen=True)
class CopyTask:
    """A synthetic prompt set: ``size`` prompts of ``digits`` digits below ``alphabet``, from ``seed``."""

    size: int = 256
    digits: int = 3
    alphabet: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.digits < 1 or not 1 <= self.alphabet <= DIGITS:
            raise ValueError(
                f"CopyTask needs size >= 1, digits >= 1 and alphabet in 1..{DIGITS}, "
                f"got {self.size}, {self.digits}, {self.alphabet}"
            )

    @property
    def max_new_tokens(self) -> int:
        """Room for the digits and the end token, and nothing more."""
        return self.digits + 1

    @property
    def max_sequence_length(self) -> int:
        """Longest prompt + response: ``BOS``, digits, ``SEP``, digits, ``EOS``."""
        return 2 * self.digits + 3

    def rows(self) -> Iterator[dict[str, Any]]:
        """Dataset rows in the JSONL layout of ``JsonlDataset(input_key="input", label_key="label")``."""
        rng = random.Random(self.seed)
        for i in range(self.size):
            text = " ".join(str(rng.randrange(self.alphabet)) for _ in range(self.digits))
            yield {"input": text, "label": text, "metadata": {"task": "copy", "row": i}}

    def write_jsonl(self, path: str | os.PathLike[str]) -> Path:
        """Write the prompt set as JSONL (one object per line) and return the path.

        The file is a plain input the job reads, not durable state: it is rewritten whole from
        the seed whenever the demo starts, so no fsync or atomic publication is needed.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows())
        target.write_text(text, encoding="utf-8")
        return target

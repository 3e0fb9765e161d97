"""The demo's policy: a tiny causal transformer whose feed-forward layers are a mixture of experts.

Pure torch on the CPU. Each block is causal self-attention followed by a mixture-of-experts
layer (a linear router picks ``top_k`` of ``num_experts`` small MLPs per token), so every
forwarded token has real routing decisions: ``routes[position, layer, k]`` = the expert id
chosen in ``k``-th place for that token in that layer. These are what ROLLOUT.md §4.1 calls
``rollout_routed_experts`` (R3): one row per forwarded token, ``len(tokens) - 1`` rows for
a finished sequence (its last token was sampled but never forwarded). Passing routes back
into :meth:`DemoPolicy.forward` replays them: the experts are the given ones and only the
gate weights come from the current router (routing replay in the training forward).

Sampling is deterministic under a seed and position-addressed: the uniform draw that picks
the token at absolute position ``p`` depends only on ``(seed, p)``. Continuing a partial
response from its tokens with the same seed and weights therefore yields exactly the tokens
an uninterrupted generation would have produced.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from . import task

__all__ = [
    "Decoding",
    "DemoPolicy",
    "Generation",
    "PolicyConfig",
    "export_weights",
    "import_weights",
    "sampling_uniform",
    "step_together",
]

# Seeds are reduced to 64 bits before they seed numpy's SeedSequence (which wants non-negative ints).
_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of the policy; the defaults learn the copy task in a few dozen GRPO steps."""

    vocab_size: int = task.VOCAB_SIZE
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_experts: int = 4
    top_k: int = 2
    d_expert: int = 48
    max_positions: int = 16
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts, got {self.top_k} of {self.num_experts}")
        if min(self.vocab_size, self.num_layers, self.max_positions, self.d_expert) < 1:
            raise ValueError("PolicyConfig sizes must be positive")


@dataclass
class Generation:
    """One generated continuation of a prefix.

    ``tokens`` and ``log_probs`` cover only the new tokens. ``routes`` has one row per token
    of ``prefix + tokens[:-1]`` from ``routes_start`` on (the last sampled token was never
    forwarded): shape ``[len(prefix) + len(tokens) - 1 - routes_start, num_layers, top_k]``,
    int32. ``finish`` is ``"stop"`` (a stop token was sampled), ``"length"`` (the token budget
    or the position limit was reached) or ``"abort"`` (stopped from outside).
    """

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    routes: Tensor | None = None
    finish: str = "length"


def sampling_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) that picks the token at absolute ``position`` under ``seed``."""
    return float(np.random.default_rng([seed & _SEED_MASK, position]).random())


class _Block(nn.Module):
    """Pre-norm causal attention followed by a top-k mixture-of-experts MLP."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        d, e, h = config.d_model, config.num_experts, config.d_expert
        self.heads = config.num_heads
        self.top_k = config.top_k
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, e, bias=False)
        self.w_in = nn.Parameter(torch.randn(e, d, h) / math.sqrt(d))
        self.b_in = nn.Parameter(torch.zeros(e, h))
        self.w_out = nn.Parameter(torch.randn(e, h, d) / math.sqrt(h))
        self.b_out = nn.Parameter(torch.zeros(e, d))

    def attend(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out

    def experts(self, x: Tensor, routes: Tensor | None) -> tuple[Tensor, Tensor]:
        """Mix the chosen experts' outputs; ``routes`` (``[b, t, top_k]``) replays a choice."""
        z = self.norm2(x)
        probs = torch.softmax(self.router(z), dim=-1)
        chosen = probs.topk(self.top_k, dim=-1).indices if routes is None else routes.long()
        gate = probs.gather(-1, chosen)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        # Every expert runs on every token: at these sizes a dense einsum is far cheaper than
        # gathering tokens per expert, and the result is the same mixture.
        hidden = F.gelu(torch.einsum("btd,edh->bteh", z, self.w_in) + self.b_in)
        out = torch.einsum("bteh,ehd->bted", hidden, self.w_out) + self.b_out
        picked = out.gather(2, chosen.unsqueeze(-1).expand(*chosen.shape, out.shape[-1]))
        return x + (picked * gate.unsqueeze(-1)).sum(dim=2), chosen


class DemoPolicy(nn.Module):
    """The policy network: token + position embeddings, ``num_layers`` MoE blocks, a head."""

    def __init__(self, config: PolicyConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config or PolicyConfig()
        # Parameters are drawn from a private generator so that building a policy never
        # disturbs (or depends on) the process-wide torch RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            c = self.config
            self.embed = nn.Embedding(c.vocab_size, c.d_model)
            self.position = nn.Embedding(c.max_positions, c.d_model)
            self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
            self.norm = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab_size)
            if c.tie_embeddings:
                self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor, routes: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Logits ``[b, t, vocab]`` and routes ``[b, t, num_layers, top_k]`` (int64).

        With ``routes`` given (same shape), each layer uses those experts instead of its
        router's top-k (routing replay); the returned routes are then the given ones.
        """
        t = tokens.shape[1]
        if t > self.config.max_positions:
            raise ValueError(f"Sequence of {t} tokens exceeds max_positions={self.config.max_positions}")
        x = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        chosen = []
        blocks: list[_Block] = list(self.blocks)  # type: ignore[arg-type]  # ModuleList items are Modules
        for layer, block in enumerate(blocks):
            x = block.attend(x)
            x, picked = block.experts(x, None if routes is None else routes[:, :, layer])
            chosen.append(picked)
        return self.head(self.norm(x)), torch.stack(chosen, dim=2)

    def token_log_probs(
        self, tokens: Tensor, routes: Tensor | None = None, *, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Log-probability of each next token: ``[b, t-1]``, and the routes of ``tokens[:, :-1]``."""
        logits, used = self(tokens[:, :-1], routes)
        scaled = torch.log_softmax(logits.float() / _scale(temperature), dim=-1)
        return scaled.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1), used

    @torch.no_grad()
    def generate(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        seeds: Sequence[int | None] | None = None,
        stop_tokens: Sequence[int] = (task.EOS,),
        routes_start: int | Sequence[int] = 0,
    ) -> list[Generation]:
        """Sample a continuation of every prefix, all rows advancing together.

        A row stops at a stop token, after its ``max_new_tokens``, or when the sequence
        reaches ``max_positions``. ``seeds[i]`` fixes row ``i``'s draws (None: a random seed).
        ``routes_start`` drops that many leading route rows (for continuing a partial whose
        earlier routes the caller keeps).
        """
        rows = len(prefixes)
        budgets = _per_row(max_new_tokens, rows, "max_new_tokens")
        starts = _per_row(routes_start, rows, "routes_start")
        decodings = [
            Decoding(self, prefix, max_new_tokens=budgets[i], temperature=temperature,
                     seed=None if seeds is None else seeds[i], stop_tokens=stop_tokens,
                     routes_start=starts[i])
            for i, prefix in enumerate(prefixes)
        ]  # fmt: skip
        while True:
            active = [d for d in decodings if not d.done]
            if not active:
                break
            step_together(self, active)
        return [d.result() for d in decodings]


class Decoding:
    """The incremental generation of one sequence, one token per :meth:`step`.

    The serving engine advances many of these between abort checks, so an abort stops a
    request between two tokens and keeps everything generated so far.
    """

    def __init__(
        self,
        policy: DemoPolicy,
        prefix: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        stop_tokens: Sequence[int] = (task.EOS,),
        routes_start: int = 0,
        top_log_probs: int = 0,
    ) -> None:
        vocab, limit = policy.config.vocab_size, policy.config.max_positions
        if not prefix:
            raise ValueError("Generation needs at least one prompt token")
        if any(not 0 <= int(t) < vocab for t in prefix):
            raise ValueError(f"Prompt token ids must be in [0, {vocab}), got {list(prefix)}")
        if len(prefix) > limit:
            raise ValueError(f"Prompt of {len(prefix)} tokens exceeds max_positions={limit}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not 0 <= routes_start <= len(prefix):
            raise ValueError(f"routes_start must be in [0, {len(prefix)}], got {routes_start}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if not 0 <= top_log_probs <= vocab:
            raise ValueError(f"top_log_probs must be in [0, {vocab}], got {top_log_probs}")
        self.policy = policy
        self.sequence = [int(t) for t in prefix]
        self.prefix_length = len(prefix)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = random.SystemRandom().getrandbits(63) if seed is None else seed
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.routes_start = routes_start
        self.log_probs: list[float] = []
        self.top_log_probs = top_log_probs
        #: Per new token, the ``top_log_probs`` most likely (token, log-prob) pairs, best first.
        self.top: list[list[tuple[int, float]]] = []
        self.routes: Tensor | None = None
        self.finish = "length"
        self.done = max_new_tokens == 0 or len(prefix) >= limit

    @property
    def new_tokens(self) -> list[int]:
        return self.sequence[self.prefix_length :]

    def step(self) -> None:
        """Generate one token (a no-op once done)."""
        if not self.done:
            step_together(self.policy, [self])

    def abort(self) -> None:
        """Stop here: the result keeps the tokens so far, with finish reason ``"abort"``."""
        if not self.done:
            self.done = True
            self.finish = "abort"

    def advance(self, logits: Tensor, routes: Tensor) -> None:
        """Take the next token from the last position's logits; record the forwarded routes."""
        scale = _scale(self.temperature)
        log_probs = torch.log_softmax(logits.float() / scale, dim=-1)
        position = len(self.sequence)
        if self.temperature == 0:
            token = int(log_probs.argmax())
        else:
            cdf = np.cumsum(log_probs.double().exp().numpy())
            u = sampling_uniform(self.seed, position) * cdf[-1]
            token = min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
        self.sequence.append(token)
        self.log_probs.append(float(log_probs[token]))
        if self.top_log_probs:
            values, ids = log_probs.topk(self.top_log_probs)
            self.top.append([(int(i), float(v)) for i, v in zip(ids, values, strict=True)])
        self.routes = routes.to(torch.int32)
        if token in self.stop_tokens:
            self.done, self.finish = True, "stop"
        elif (
            len(self.new_tokens) >= self.max_new_tokens
            or len(self.sequence) >= self.policy.config.max_positions
        ):
            self.done, self.finish = True, "length"

    def result(self) -> Generation:
        """The tokens, log-probs and routes so far (routes only for forwarded positions)."""
        width = (self.policy.config.num_layers, self.policy.config.top_k)
        forwarded = len(self.sequence) - 1 if self.new_tokens else self.prefix_length - 1
        if self.routes is None or not self.new_tokens:
            routes = torch.zeros((0, *width), dtype=torch.int32)
        else:
            routes = self.routes[self.routes_start : forwarded].clone()
        return Generation(list(self.new_tokens), list(self.log_probs), routes, self.finish)


def _scale(temperature: float) -> float:
    """Divisor of the logits: the temperature, or 1 for greedy decoding (its log-probs)."""
    return temperature if temperature > 0 else 1.0


def _per_row(value: int | Sequence[int], rows: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * rows
    if len(value) != rows:
        raise ValueError(f"{name} has {len(value)} entries for {rows} prefixes")
    return [int(v) for v in value]


def step_together(policy: DemoPolicy, decodings: Sequence[Decoding]) -> None:
    """One token for each decoding, in one padded forward pass.

    Rows are right-padded; causal attention keeps every real position from seeing the pads,
    so each row's logits are those of its own sequence.
    """
    width = max(len(d.sequence) for d in decodings)
    batch = torch.zeros((len(decodings), width), dtype=torch.long)
    for i, d in enumerate(decodings):
        batch[i, : len(d.sequence)] = torch.tensor(d.sequence)
    with torch.no_grad():
        logits, routes = policy(batch)
    for i, d in enumerate(decodings):
        last = len(d.sequence) - 1
        d.advance(logits[i, last], routes[i, : last + 1])


def export_weights(policy: nn.Module) -> dict[str, Tensor]:
    """The policy's weights as a flat dict of detached, contiguous CPU tensors (a copy)."""
    return {name: value.detach().cpu().contiguous().clone() for name, value in policy.state_dict().items()}


def import_weights(policy: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Load weights exported by :func:`export_weights`; names and shapes must match exactly."""
    current = policy.state_dict()
    missing = sorted(set(current) - set(weights))
    unexpected = sorted(set(weights) - set(current))
    if missing or unexpected:
        raise ValueError(f"Policy weights do not match: missing {missing}, unexpected {unexpected}")
    for name, value in weights.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"Policy weight {name!r} is {type(value).__name__}, not a torch.Tensor")
        if tuple(value.shape) != tuple(current[name].shape):
            expected = tuple(current[name].shape)
            raise ValueError(f"Policy weight {name!r} has shape {tuple(value.shape)}, expected {expected}")
    with torch.no_grad():
        for name, target in current.items():
            target.copy_(weights[name])

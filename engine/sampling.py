"""Sampling and speculative acceptance, vectorised over rows and draft positions, without host syncs.

Randomness is counter-based: every random number is a hash of (sequence seed, token position, stream,
token id). A seeded request therefore draws the same numbers whatever else shares its batch, and each
number is used for at most one decision that reaches the output (see `accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exspec.engine.types import TokenLogprob

_M32 = 0xFFFFFFFF
STREAM_DRAFT = 1  # the draft's proposal at a position
STREAM_ACCEPT = 2  # the acceptance test of the draft token at a position
STREAM_TARGET = 3  # a token drawn from the target (first token, correction, bonus, no speculation)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors; multipliers < 2**31 so nothing overflows."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    return x


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab: int | None = None) -> torch.Tensor:
    """Uniform numbers in (0, 1) keyed by (seed, position, stream[, token]).

    seeds: [B] long; positions: [B, Q] long -> [B, Q] (or [B, Q, vocab] when vocab is given) float32
    """
    s = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))  # [B]
    h = _mix32(s[:, None] ^ _mix32(positions * 4 + stream))  # [B, Q]
    if vocab is not None:
        tok = _mix32(torch.arange(vocab, device=seeds.device) + 0x3C6EF372)  # [vocab]
        h = _mix32(_mix32(h[..., None] ^ tok) + stream)  # [B, Q, vocab]
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One draw per row and position from `probs` (need not be normalised): the exponential race
    argmax(p / E), E ~ Exp(1), which picks v with probability p_v / sum(p). No host sync.

    probs: [B, Q, V]; positions: [B, Q] -> [B, Q] long
    """
    e = -torch.log(uniform(seeds, positions, stream, probs.shape[-1]))  # [B, Q, V]
    return torch.argmax(probs / e, dim=-1)


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters of one batch, on device. When any_sampling is False (every row greedy) the
    tensors may be empty: read them only behind any_sampling."""

    temperature: torch.Tensor  # [B] float; 0 marks a greedy row
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long; 0: off
    seeds: torch.Tensor  # [B] long
    any_sampling: bool  # host flag: some row has temperature > 0
    any_filter: bool  # host flag: some sampling row uses top-k or top-p


def process_probs(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, then top-p; greedy rows get the
    one-hot of their argmax, so greedy and sampled rows share the acceptance rule.

    logits: [B, Q, V] float32 -> probs [B, Q, V]
    """
    greedy = rp.temperature <= 0  # [B]
    temp = torch.where(greedy, torch.ones_like(rp.temperature), rp.temperature)
    x = logits / temp[:, None, None]
    if rp.any_filter:
        x = _filter_top_k_top_p(x, rp.top_k, rp.top_p)
    probs = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None, None], onehot, probs)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (at least one token is always kept)."""
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [B, Q, V]
    rank = torch.arange(vocab, device=x.device)  # [V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [B]
    drop = rank[None, None, :] >= k[:, None, None]  # [B, 1, V]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, Q, V]
    # Rows with top_p == 1 cut nothing: their float32 cumsum can round to 1 before the tail.
    drop = drop | ((mass_before >= top_p[:, None, None]) & (top_p < 1.0)[:, None, None])
    drop[..., 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def accept(
    draft_tokens: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor,  # [B, k, V]: the distributions the draft tokens were sampled from (q)
    target_probs: torch.Tensor,  # [B, k + 1, V]: the target's distributions at the same positions (p)
    allow: torch.Tensor,  # [B, k] bool: draft column j of row b may be accepted (False past the row's budget)
    seeds: torch.Tensor,  # [B] long
    positions: torch.Tensor,  # [B, k + 1] long: sequence position of the token each column produces
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

    Terms, used the same way everywhere in exspec:
    - draft tokens d_1..d_k: proposed by the draft, d_i ~ q_i.
    - accepted: d_i is kept if u_i < p_i(d_i) / q_i(d_i) and d_1..d_{i-1} were kept; the acceptance length
      a in [0, k] counts the kept prefix.
    - correction (recovered) token: on the first rejection (a < k), a token drawn from
      norm(max(p_{a+1} - q_{a+1}, 0)).
    - bonus token: when all k are accepted, a token drawn from p_{k+1}.
    Every step therefore emits a + 1 tokens, distributed exactly as the target alone would emit them.
    Greedy rows have one-hot p and q: a draft token is kept iff it equals the target's argmax, and the
    correction/bonus is the target's argmax. A row whose draft budget is k_b < k (opted out of speculation:
    k_b = 0; near the end of its context) has allow[b, j] = False for j >= k_b: it accepts at most k_b drafts,
    and its token after them is drawn from p itself, exactly as a k_b-token step would draw it.

    returns: tokens [B, k + 1] (first a+1 are the output), num_accepted [B] long. No host sync.
    """
    k = draft_tokens.shape[1]
    p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    q_d = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    u = uniform(seeds, positions[:, :k], STREAM_ACCEPT)  # [B, k]
    kept = (u * q_d < p_d) & allow  # [B, k]
    num_accepted = torch.cumprod(kept.long(), dim=1).sum(dim=1)  # [B]
    q_eff = draft_probs * allow[:, :, None]  # columns past a row's budget: residual is p itself
    residual = (target_probs[:, :k] - q_eff).clamp_(min=0)  # [B, k, V]
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q exactly: never rejected, any valid draw will do
    residual = torch.where(empty, target_probs[:, :k], residual)
    fallback = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k + 1, V]
    fix = sample_from_probs(fallback, seeds, positions, STREAM_TARGET)  # [B, k + 1]
    col = torch.arange(k + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, fix[:, k:]], dim=1)  # [B, k + 1]
    tokens = torch.where(col[None, :] < num_accepted[:, None], padded, fix)
    return tokens, num_accepted


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor, allow: torch.Tensor):
    """The all-greedy case of `accept` without building distributions: the output is the target's argmax.

    draft_tokens: [B, k]; target_logits: [B, k + 1, V]; allow: [B, k] bool -> tokens [B, k + 1], num_accepted [B]
    """
    target_tokens = target_logits.argmax(-1)  # [B, k + 1]
    kept = (draft_tokens == target_tokens[:, :-1]) & allow  # [B, k]
    return target_tokens, torch.cumprod(kept.long(), dim=1).sum(dim=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's log-probability under `logits` (raw: no temperature or filters), then the n most likely ids and
    their log-probabilities, in float64 (exact for any token id), to be read back with the step's tokens. No host sync.

    logits: [B, Q, V]; tokens: [B, Q] long -> [B, Q, 1 + 2n] float64
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [B, Q, 1]
    chosen = x.gather(-1, tokens[..., None]) - lse  # [B, Q, 1]
    top_x, top_id = x.topk(n, dim=-1)  # [B, Q, n] each
    return torch.cat([chosen.double(), top_id.double(), (top_x - lse).double()], dim=-1)


def read_logprobs(values: list[float], num_tokens: int, width: int, n: int):
    """The first `num_tokens` positions' TokenLogprob from a row of `token_logprobs` read back as a flat list
    ([Q * (1 + 2 * width)]: the batch's `width` alternatives a position), keeping the row's own n <= width."""
    step = 1 + 2 * width
    out = []
    for i in range(num_tokens):
        base = i * step
        ids = values[base + 1 : base + 1 + n]
        lps = values[base + 1 + width : base + 1 + width + n]
        out.append(TokenLogprob(values[base], tuple(zip(map(int, ids), lps))))
    return tuple(out)

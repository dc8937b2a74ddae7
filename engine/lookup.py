"""Draft tokens without a draft model: n-gram lookup in each sequence's own tokens (prompt lookup decoding,
Saxena 2023; vLLM's `ngram` method), vectorised over rows, no host sync.

A row's last n tokens (n from `max_n` down to `min_n`, the longest that matches) are looked for earlier in the
same row, prompt and generated tokens alike; at the most recent earlier occurrence, the tokens that followed it
are the proposal. Where the copy runs into the row's end (the match is less than k tokens back: a loop), it goes
on from the tokens it has just proposed, as the sequence would if it kept repeating: proposal i is the token at
`start + i mod (length - start)`, `start` the position after the match. A row with no match proposes nothing
(`valid` False). The engine looks each row up once per call, when the call commits (`ngram_proposals` over the
row's new tokens: the next step's proposals, kept on the device, and the match length, read with the step's tokens):
a row whose lookup matches nothing drafts nothing in the next step (k = 0 for it: it is not counted as drafting), and
a step where no row matches verifies one column, a plain decoding step, whatever k the scheduler asked for.

Why: a greedy small model copies from its prompt (summaries, quotes, code, retrieved text) and repeats itself.
On the demo pair's 16 held-out SpecBench prompts SmolLM2-135M's greedy answers continue a 4-token match 86% of
the time, and the lookup proposes the right token at 36% of positions against the trained draft's 10%
(docs/BENCHMARKS.md section 5). A proposal costs no forward: a verify of k + 1 columns is the whole price.
"""

from __future__ import annotations

import torch


def ngram_match(hist: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int):
    """hist [B, T] long, lengths [B] long (as in `propose_ngram`). returns start [B] long (the position after each
    row's chosen match; 0 where none), n [B] long (the matched suffix's length, max_n .. min_n; 0: no match)."""
    B, T = hist.shape
    dev = hist.device
    pos = torch.arange(T, device=dev)  # [T]
    start = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
    found_n = torch.zeros(B, dtype=torch.long, device=dev)  # [B]
    for n in range(max_n, min_n - 1, -1):  # longest first; at most max_n - min_n + 1 passes, not a loop over rows
        if T <= n:
            continue
        idx = (lengths[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)  # [B, n]
        suffix = hist.gather(1, idx)  # [B, n]: the row's last n tokens
        hit = (hist.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # [B, T - n + 1]: window j = hist[j : j + n]
        j = pos[: T - n + 1]
        # The token after the window must be known (j + n < length), which also rules out the suffix itself.
        hit &= j[None, :] + n < lengths[:, None]
        last = torch.where(hit, j[None, :], -1).amax(dim=1)  # [B]: the most recent match, -1 for none
        take = (found_n == 0) & (last >= 0)
        start = torch.where(take, last + n, start)
        found_n = torch.where(take, n, found_n)
    return start, found_n


def ngram_proposals(hist: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    """hist [B, T] long: each row's tokens, positions >= its length ignored; lengths [B] long, each <= T.
    returns tokens [B, k] long (the proposals; anything where nothing matched), n [B] long (`ngram_match`'s length of
    the matched suffix, 0: none). The first j of k proposals are the j proposals (a prefix)."""
    T = hist.shape[1]
    start, found_n = ngram_match(hist, lengths, min_n, max_n)  # [B], [B]
    period = (lengths - start).clamp(min=1)  # [B]: how far back the copied tokens lie
    src = start[:, None] + torch.remainder(torch.arange(k, device=hist.device)[None, :], period[:, None])  # [B, k]
    return hist.gather(1, src.clamp(max=T - 1)), found_n  # [B, k], [B]


def propose_ngram(hist: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    """As `ngram_proposals`, returning tokens [B, k] long and valid [B, k] bool (something matched)."""
    tokens, found_n = ngram_proposals(hist, lengths, k, min_n, max_n)
    return tokens, (found_n > 0)[:, None].expand_as(tokens)

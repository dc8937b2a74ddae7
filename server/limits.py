"""Request checks that depend on the model or on the server's settings: the vocabulary, the context
length, and the limits of `ServerConfig`. Each failure is a 400 naming the field and its allowed range;
after these checks nothing a request carries can overflow a tensor or slow the step loop down."""

from __future__ import annotations

from exspec.scheduler import LOGIT_BIAS_MAX, MAX_LOGPROBS
from exspec.server.config import ServerConfig
from exspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

SEED_MODULUS = 2**63  # the engine's generators take seeds in [0, 2**63)
GREEDY_BELOW = 1e-5  # a temperature below this is treated as 0 (greedy): dividing logits by it overflows


def _bad(param: str, rule: str, got: object, flag: str | None = None) -> APIError:
    where = f" (server limit {flag})" if flag else ""
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return APIError(400, f"{param} must be {rule}{where}, got {shown}", param=param)


def check_sampling(req: CompletionRequest | ChatCompletionRequest, config: ServerConfig, vocab_size: int) -> None:
    """The fields both endpoints share."""
    if req.n > config.max_n:
        raise _bad("n", f"in [1, {config.max_n}]", req.n, "--max-n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of > config.max_n:
        raise _bad("best_of", f"in [1, {config.max_n}]", best_of, "--max-n")
    if req.top_k is not None and req.top_k > vocab_size:
        raise _bad("top_k", f"-1 or 0 (off), or in [1, {vocab_size}] (the vocabulary size)", req.top_k)
    stops = req.stop_strings()
    if len(stops) > config.max_stop:
        raise _bad("stop", f"at most {config.max_stop} strings", f"{len(stops)} strings", "--max-stop")
    for s in stops:
        if not 1 <= len(s) <= config.max_stop_chars:
            raise _bad("stop", f"strings of 1 to {config.max_stop_chars} characters", s, "--max-stop-chars")
    ids = req.stop_token_ids or ()
    if len(ids) > config.max_stop_token_ids:
        raise _bad("stop_token_ids", f"at most {config.max_stop_token_ids} ids", f"{len(ids)} ids",
                   "--max-stop-token-ids")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise _bad("stop_token_ids", f"ids in [0, {vocab_size})", out[:5])


def check_logprobs(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """logprobs (completions) or top_logprobs (chat): alternatives per token, at most MAX_LOGPROBS (and the
    vocabulary)."""
    most = min(MAX_LOGPROBS, vocab_size)
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.logprobs > most:
            raise _bad("logprobs", f"in [0, {most}]", req.logprobs)
        return
    if req.top_logprobs is not None and req.top_logprobs > most:
        raise _bad("top_logprobs", f"in [0, {most}]", req.top_logprobs)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def engine_logit_bias(req: CompletionRequest | ChatCompletionRequest, config: ServerConfig,
                      vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as the engine takes it: (token id, bias) pairs, at most `--max-logit-bias` of them, each key a
    token id written in decimal, in the vocabulary, once; each bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's
    -100 to 100)."""
    if not req.logit_bias:
        return ()
    if len(req.logit_bias) > config.max_logit_bias:
        raise _bad("logit_bias", f"at most {config.max_logit_bias} entries", f"{len(req.logit_bias)} entries",
                   "--max-logit-bias")
    pairs = {}
    for key, value in req.logit_bias.items():
        text = key.strip()
        if not (text.isascii() and text.isdigit() and int(text) < vocab_size):
            raise _bad("logit_bias", f"keyed by token ids in [0, {vocab_size}) written in decimal", key)
        if int(text) in pairs:
            raise _bad("logit_bias", "keyed by distinct token ids", key)
        if not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
            raise _bad("logit_bias", f"values in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]", value)
        pairs[int(text)] = float(value)
    return tuple(sorted(pairs.items()))


def check_min_tokens(req, max_tokens: int) -> None:
    if req.min_tokens > max_tokens:
        raise _bad("min_tokens", f"in [0, max_tokens={max_tokens}]", req.min_tokens)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Every id of a token-id prompt is an integer in the vocabulary (call after the length check, so that
    `ids` is at most max_model_len long)."""
    out = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]
    if out:
        raise _bad(param, f"token ids in [0, {vocab_size})", out[:5])


def check_completion_prompts(req: CompletionRequest, config: ServerConfig) -> None:
    p = req.prompt
    if isinstance(p, str):
        texts = [p]
    else:
        if len(p) == 0:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return  # one token-id prompt: its length and ids are checked against the model
        if len(p) > config.max_prompts:
            raise _bad("prompt", f"at most {config.max_prompts} prompts", f"{len(p)} prompts", "--max-prompts")
        texts = p if isinstance(p[0], str) else []
    for t in texts:
        if len(t) > config.max_prompt_chars:
            raise _bad("prompt", f"at most {config.max_prompt_chars} characters", f"{len(t)} characters",
                       "--max-prompt-chars")


def check_messages(req: ChatCompletionRequest, config: ServerConfig) -> None:
    if len(req.messages) > config.max_messages:
        raise _bad("messages", f"at most {config.max_messages} messages", f"{len(req.messages)} messages",
                   "--max-messages")
    chars = 0
    for m in req.messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif m.content is not None:
            chars += sum(len(getattr(part, "text", "")) for part in m.content)
    if chars > config.max_prompt_chars:
        raise _bad("messages", f"at most {config.max_prompt_chars} characters of content in all",
                   f"{chars} characters", "--max-prompt-chars")


def max_token_chars(tokenizer) -> int:
    """The most characters one token can decode to, bounded from above by its vocabulary entry's length (a
    byte-level entry has one character per byte; a SentencePiece or WordPiece entry is no shorter than its
    text). Special tokens count too."""
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1


def check_fits_in_tokens(chars: int, max_model_len: int, token_chars: int, param: str) -> None:
    """A text of `chars` characters has at least chars / token_chars tokens: refuse at once, without
    tokenizing, one that cannot fit (with a factor 2 of margin for normalizers that shorten text)."""
    bound = 2 * max_model_len * token_chars
    if chars > bound:
        raise APIError(
            400,
            f"{param} has {chars} characters: more than the {max_model_len} tokens of this model's context can "
            f"hold (at most {bound} characters here; a token is at most {token_chars} characters)",
            param=param, code="context_length_exceeded",
        )


def engine_seed(seed: int | None, choice: int) -> int | None:
    """Choice `choice`'s seed: any integer (negative, beyond 64 bits) reduced to the engine's [0, 2**63)."""
    return None if seed is None else (seed + choice) % SEED_MODULUS


def engine_temperature(temperature: float | None) -> float:
    """OpenAI's default 1.0; a temperature below GREEDY_BELOW is greedy (exactly 0)."""
    if temperature is None:
        return 1.0
    return 0.0 if temperature < GREEDY_BELOW else temperature

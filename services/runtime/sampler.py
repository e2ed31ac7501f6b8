"""Sampling: the per-request SamplingParams and the Sampler that turns logits into next tokens.

Per row: penalties -> logit_bias -> min_tokens mask -> grammar mask -> argmax when greedy, else
temperature -> top-k -> top-p -> min-p -> a draw. Rows without a bias, a mask or penalties keep
the model's logits bit for bit. The draw is a pure function of (seed, position, logits), so any
worker that samples a request's token at a position draws the same one.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.common.sampling_params import MAX_LOGPROBS, SamplingParams  # noqa: F401 (re-exported)
from services.runtime.grammar import GrammarMatcher, disallowed_tokens

_TOP_P_CANDIDATES = 128  # first guess at how many tokens a top-p cut keeps
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleRequest:
    """One row of a batch to sample.

    `position` is the index, in the whole sequence, of the token being sampled. `eos_token_ids`
    are masked with `stop_token_ids` until `min_tokens` are out (unless `ignore_eos`). A `grammar`
    masks every token it does not allow.
    """

    params: SamplingParams
    seed: int  # resolved: see resolve_seed
    position: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # None when the request asked for no logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or a fresh random 63-bit one so a seedless request can still move between workers."""
    return secrets.randbits(63) if seed is None else seed


class Sampler:
    """Samples one token per row of a logits batch.

    A drawn row uses one uniform number, a splitmix64 hash of (seed, position), to pick its token
    by inverse CDF: no generator state, so batching and retries cannot change the draw.
    Logprobs are vLLM's default "raw" logprobs: log_softmax of the model's logits before
    penalties, temperature and filtering, so they describe the model, not the sampling settings.
    """

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(requests)} requests; "
                             "expected [num_requests, vocab_size]")
        if not requests:
            return []
        raw = logits.float()
        adjusted = _adjusted_logits(raw, requests)
        drawn = [i for i, r in enumerate(requests) if not r.params.greedy]
        if len(drawn) < len(requests):
            token_ids = _greedy(adjusted)
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long, device=raw.device)
        if drawn:
            rows = _index(drawn, raw.device)
            probs = sampling_probs(adjusted[rows], [requests[i].params for i in drawn])
            token_ids[rows] = _draw(probs, [_uniform(requests[i].seed, requests[i].position) for i in drawn])
        return _with_logprobs(raw, token_ids, requests)


def apply_penalties(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    """Apply vLLM's penalties in place to logits [B, V], row i for requests[i].

    Repetition divides positive logits (multiplies negative ones) of every token seen in the
    prompt or output; then frequency subtracts per output occurrence, presence once per token.
    Neutral values change nothing, exactly: x / 1, x * 1 and x - 0 are x.
    """
    output_counts = _token_counts(logits, [r.output_token_ids for r in requests])
    if any(r.params.repetition_penalty != 1.0 for r in requests):
        seen = (output_counts + _token_counts(logits, [r.prompt_token_ids for r in requests])) > 0
        repetition = _column([r.params.repetition_penalty for r in requests], logits)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalized, logits))
    if any(r.params.frequency_penalty != 0.0 for r in requests):
        logits -= _column([r.params.frequency_penalty for r in requests], logits) * output_counts
    if any(r.params.presence_penalty != 0.0 for r in requests):
        logits -= _column([r.params.presence_penalty for r in requests], logits) * (output_counts > 0)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row draws from: temperature, then top-k, top-p and min-p filtering.

    Rows must not be greedy. Returns probabilities [B, V]; filtered tokens have probability 0.
    """
    if any(p.greedy for p in params):
        raise ValueError("sampling_probs takes non-greedy rows only; greedy rows take the argmax")
    # Shifting by the row max first keeps a tiny temperature from overflowing to inf - inf = NaN.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / _column([p.temperature for p in params], logits)
    _top_k_(scaled, [p.top_k for p in params])
    _top_p_(scaled, [p.top_p for p in params])
    _min_p_(scaled, [p.min_p for p in params])
    return torch.softmax(scaled, dim=-1)


def _adjusted_logits(raw: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """Penalties, logit_bias, the min_tokens mask and grammar masks on a copy; `raw` stays as it is
    for the logprobs."""
    penalized = [i for i, r in enumerate(requests) if r.params.has_penalties]
    biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
    masked = [i for i, r in enumerate(requests) if len(r.output_token_ids) < r.params.min_tokens]
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not penalized and not biased and not masked and not constrained:
        return raw
    adjusted = raw.clone()
    if penalized:
        index = _index(penalized, raw.device)
        rows = adjusted[index]
        apply_penalties(rows, [requests[i] for i in penalized])
        adjusted[index] = rows
    for i in biased:
        _add_logit_bias(adjusted[i], requests[i].params)
    for i in masked:
        _mask_stop_tokens(adjusted[i], requests[i])
    if constrained:
        _mask_by_grammar(adjusted, requests, constrained)
    return adjusted


def _add_logit_bias(row: torch.Tensor, params: SamplingParams) -> None:
    """Add each clamped bias to its token's logit (ids were checked against the vocabulary on admission)."""
    ids, biases = zip(*params.clamped_logit_bias)
    row[torch.tensor(ids, dtype=torch.long, device=row.device)] += torch.tensor(biases, dtype=row.dtype,
                                                                                device=row.device)


def _mask_by_grammar(logits: torch.Tensor, requests: list[SampleRequest], rows: list[int]) -> None:
    """Set the logits of the tokens each row's grammar does not allow to -inf, in place."""
    disallowed = disallowed_tokens([requests[i].grammar for i in rows], logits.shape[1],  # type: ignore[misc]
                                   requests[rows[0]].eos_token_ids).to(logits.device)
    for mask_row, i in enumerate(rows):
        logits[i].masked_fill_(disallowed[mask_row], -math.inf)


def _mask_stop_tokens(row: torch.Tensor, request: SampleRequest) -> None:
    params = request.params
    stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
    # A stop id beyond the logits can never be drawn, so there is nothing to mask.
    stops = [t for t in stops if t < row.shape[0]]
    if stops:
        row[torch.tensor(stops, dtype=torch.long, device=row.device)] = -math.inf


def _top_k_(logits: torch.Tensor, top_ks: list[int]) -> None:
    """Keep each row's k highest logits (and any tied with the k-th); k <= 0 or >= V is off."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    if not any(ks):
        return
    top = logits.topk(max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device).unsqueeze(1))
    active = torch.tensor([k > 0 for k in ks], device=logits.device).unsqueeze(1)
    kth = torch.where(active, kth, -math.inf)
    logits.masked_fill_(logits < kth, -math.inf)


def _top_p_(logits: torch.Tensor, top_ps: list[float]) -> None:
    """Keep the most likely tokens until their mass reaches p, and every token tied with the last.

    Peaked rows need only their top candidates; a full sort is the fallback for flat ones.
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    index = _index(rows, logits.device)
    sub = logits[index]
    probs = sub.softmax(dim=-1)
    top_p = _column([top_ps[i] for i in rows], probs)
    best = probs.topk(min(probs.shape[1], _TOP_P_CANDIDATES), dim=-1).values
    kept = _count_within_mass(best, top_p)
    if bool((kept == best.shape[1]).any()):
        # A flat distribution: the cut lies beyond the candidates, so sort the whole rows.
        best = probs.sort(dim=-1, descending=True).values
        kept = _count_within_mass(best, top_p)
    threshold = best.gather(1, kept - 1)
    logits[index] = sub.masked_fill(probs < threshold, -math.inf)


def _count_within_mass(best: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, how many of the probabilities `best` (sorted high to low) it takes to reach top_p."""
    mass_before = torch.zeros_like(best)
    mass_before[:, 1:] = best.cumsum(dim=-1)[:, :-1]
    return (mass_before < top_p).sum(dim=-1, keepdim=True)


def _min_p_(logits: torch.Tensor, min_ps: list[float]) -> None:
    """Drop tokens whose probability is below min_p times the row's highest probability."""
    rows = [i for i, p in enumerate(min_ps) if p > 0.0]
    if not rows:
        return
    index = _index(rows, logits.device)
    sub = logits[index]
    probs = sub.softmax(dim=-1)
    min_p = _column([min_ps[i] for i in rows], probs)
    logits[index] = sub.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)


def _draw(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Inverse-CDF draw: per row, the first token whose cumulative probability exceeds u * total."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = _column(uniforms, cdf)
    # Staying strictly below the total guarantees the chosen token has a probability above 0.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): the whole source of randomness."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's best token; ties go to the lowest id (both argmaxes return the first maximal
    index). On the CPU numpy's vectorized argmax takes a tenth of torch's max over a dim (1.3 ms
    for 32 rows of 49,152 on one core)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, requests: list[SampleRequest]) -> list[SampledToken]:
    """Each row's token, with its logprobs only where the request asked for them: a log-softmax
    over the vocabulary is a large share of a wide batch's sampling, so rows without are spared it."""
    ids = token_ids.tolist()
    asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not asked:
        return [SampledToken(t, None) for t in ids]
    if len(asked) < len(requests):
        rows = _index(asked, raw.device)
        raw, token_ids = raw[rows], token_ids[rows]
    lse = torch.logsumexp(raw, dim=-1)
    chosen = (raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse).tolist()
    tops = _top_logprobs(raw, lse, [requests[i].params.logprobs or 0 for i in asked])
    tokens = [SampledToken(t, None) for t in ids]
    for row, logprob, top in zip(asked, chosen, tops):
        tokens[row] = SampledToken(ids[row], logprob, top)
    return tokens


def score_tokens(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[SampledToken]:
    """Each row's logprob of its token in `token_ids` (fp32 log_softmax of the raw logits), with
    the `top_n` most likely alternatives: the prompt's logprobs under teacher forcing."""
    raw = logits.float()
    lse = torch.logsumexp(raw, dim=-1)
    ids = torch.tensor(token_ids, device=raw.device)
    chosen = (raw.gather(1, ids.unsqueeze(1)).squeeze(1) - lse).tolist()
    tops = _top_logprobs(raw, lse, [top_n] * len(token_ids))
    return [SampledToken(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def _top_logprobs(raw: torch.Tensor, lse: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]]]:
    tops: list[list[tuple[int, float]]] = [[] for _ in counts]
    rows = [i for i, n in enumerate(counts) if n > 0]
    if not rows:
        return tops
    index = _index(rows, raw.device)
    values, ids = raw[index].topk(min(max(counts), raw.shape[1]), dim=-1)
    values = values - lse[index].unsqueeze(1)
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
        best_first = sorted(zip(row_ids, row_values), key=lambda pair: (-pair[1], pair[0]))
        tops[row] = best_first[: counts[row]]
    return tops


def _token_counts(like: torch.Tensor, token_lists: list[Sequence[int]]) -> torch.Tensor:
    """How often each token occurs in each row's list, shaped and typed like `like` [B, V]."""
    counts = torch.zeros_like(like)
    lengths = [len(tokens) for tokens in token_lists]
    if not any(lengths):
        return counts
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=like.device)
    vocab = like.shape[1]
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) to match the logits, got {low}..{high}")
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=like.device),
                                   torch.tensor(lengths, device=like.device))
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=like.dtype), accumulate=True)
    return counts


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)

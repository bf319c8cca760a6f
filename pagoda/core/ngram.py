"""Draft tokens for speculative decoding by prompt lookup (vLLM's n-gram method, `--num-speculative-tokens`).

Text that repeats what came before (code being edited, a summary quoting its source, a list that follows a pattern)
can be guessed from the sequence itself: find the latest earlier place where its last n tokens occur, and propose
the k tokens that followed them there. The longest n from ngram_prompt_lookup_max down to ngram_prompt_lookup_min
that matches wins. The engine verifies the drafts in one forward pass and keeps those the model's own sampling
accepts (Sampler.verify), so what is generated follows the model's distribution exactly; drafts only change how many
tokens a step yields.

The search is bytes.rfind over the tokens as int32 (Request.token_array: kept per request and extended by the tokens
added since the last call): where nothing matches (every n searched through the whole sequence), 3 us for 500
tokens, 8 for 2,000 and 25 for 8,000 on the Zen 4 machine (timeit, random tokens).
"""

from __future__ import annotations

from pagoda.request import Request

_ITEM = 4  # bytes of a token in the search buffer (int32)


# How fast a request's record of accepted drafts follows its latest checks (the weight of the newest).
ACCEPTED_WEIGHT = 0.3


class NgramProposer:
    """Drafts by prompt lookup: num_tokens of them, or, adaptive, as many as a request has lately had accepted plus
    one (at most num_tokens).

    Why adaptive: every draft is a row more in the verifying call, and rows that are rejected cost without yielding.
    A request keeps an average of the drafts accepted per check (weighted ACCEPTED_WEIGHT toward the latest;
    num_tokens at first), and drafts one more than that, rounded: one where its drafts keep failing (the cheapest
    probe that can still find a run of repeats), num_tokens where they keep being accepted. One stream, 16 code
    rewrites, K = 4, Zen 4, the tokens/s without drafts as 1 (BENCHMARKS.md): with q4_1, where a row costs most,
    greedy 1.36-1.52x against 1.26-1.27x for K drafts always, temperature 1 1.01-1.04x against 0.79-0.97x; with
    q8_0 and bfloat16 it loses a little of greedy's gain (1.49-1.68x against 1.56-1.77x) and wins more where few
    drafts are kept (temperature 1: 1.11-1.24x in five rounds of six against 0.92-1.13x); with float32 weights,
    whose step the weights' read bounds, a row costs least and it loses much of greedy's gain (1.35-1.87x against
    1.75-2.21x) for nothing clear at temperature 1 (0.95x and 1.25x against 0.93x and 1.10x). So LLMEngine makes
    it adaptive for every format but float32."""

    def __init__(self, num_tokens: int, lookup_max: int, lookup_min: int, adaptive: bool = False) -> None:
        self.num_tokens = num_tokens
        self.lookup_max = lookup_max
        self.lookup_min = lookup_min
        self.adaptive = adaptive
        self._accepted: dict[str, float] = {}  # request id -> drafts accepted per check, on average

    def record(self, request_id: str, accepted: int) -> None:
        """A check of the request's drafts accepted this many."""
        before = self._accepted.get(request_id, float(self.num_tokens))
        self._accepted[request_id] = (1 - ACCEPTED_WEIGHT) * before + ACCEPTED_WEIGHT * accepted

    def length(self, request_id: str) -> int:
        """How many drafts the request gets next: num_tokens, or, adaptive, its average accepted plus one, rounded,
        at most num_tokens."""
        if not self.adaptive:
            return self.num_tokens
        return min(self.num_tokens, int(self._accepted.get(request_id, float(self.num_tokens)) + 1.5))

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(length, limit) draft tokens to follow req's tokens; none where no n-gram matches."""
        limit = min(limit, self.length(req.request_id))
        if limit <= 0:
            return []
        tokens = req.token_array()
        data = tokens.tobytes()
        n_tokens = len(tokens)
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            pattern = data[-n * _ITEM:]
            end = (n_tokens - 1) * _ITEM  # a match must end before the last token, so something follows it
            while (at := data.rfind(pattern, 0, end)) >= 0:
                if at % _ITEM == 0:
                    start = at // _ITEM + n
                    return tokens[start:start + limit].tolist()
                end = at + len(pattern) - 1  # a match across token boundaries: look further back
        return []

    def forget(self, request_id: str) -> None:
        self._accepted.pop(request_id, None)

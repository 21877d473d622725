"""The dichotomic search of CalcGraph's Algorithm 1 ("CalcGraph: taming the high costs of deep learning using
models (2022)", Section 4.3): the largest batch (or number of models) whose predicted memory fits a budget."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["search_max"]


def search_max(fits: Callable[[int], bool], first_guess: int, *, limit: int = 2**24) -> tuple[int, int]:
    """Largest n >= 1 with `fits(n)` (monotone), by the dichotomic search of Algorithm 1.

    Start from the linear guess, step up (doubling) while it fits and down (halving) while it
    does not, then bisect until n fits and n + 1 does not. Returns (n, evaluations); n = 0 when
    1 does not fit. # NOTE: the paper steps by +-1 from the linear guess; doubling and bisection
    reach the same fixed point in O(log n) evaluations of the plan. Batch 1 is asked only where 2 does not
    fit: in a plan it can be a program of its own, traced at its first need (`CompiledGraph._batch_one`).
    """
    calls = 0

    def test(n: int) -> bool:
        nonlocal calls
        calls += 1
        return fits(n)

    n = min(max(1, int(first_guess)), limit)
    if test(n):
        lo, hi = n, None
        while hi is None and lo < limit:
            nxt = min(lo * 2, limit)
            if test(nxt):
                lo = nxt
            else:
                hi = nxt
        if hi is None:
            return lo, calls
    else:
        hi = n
        while True:  # halve until a batch fits: hi does not
            lo = hi // 2
            if lo < 1:
                return 0, calls
            if test(lo):
                break
            hi = lo
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return lo, calls

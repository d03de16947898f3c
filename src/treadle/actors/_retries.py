"""When a failed model attempt is tried again, and after how long.

Pure functions of the attempt's recorded error, its call's failure count and the agent's
`treadle.types.Limits` (docs/models.md, "Errors and retryability"): the model gateway decides
with them live, the run coordinator on resume, so a step the log shows ended by a final error
ends the same after a crash (docs/crash-safety.md, "Resume").
"""

from __future__ import annotations

import random

from treadle.types import Limits, ModelErrorInfo


def backoff_s(retry: int, limits: Limits, rng: random.Random) -> float:
    """Seconds to wait before retry number ``retry`` (1-based).

    Exponential from ``limits.retry_initial_s``, capped at ``limits.retry_max_s``, with
    "equal jitter" (half fixed, half uniform random).

    The random source is injected so simulations are reproducible (docs/simulation.md,
    "Determinism"); see docs/decisions/0003-own-backoff.md.
    """
    ceiling = min(limits.retry_max_s, limits.retry_initial_s * 2.0 ** (retry - 1))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


def ends_the_call(error: ModelErrorInfo, failures: int, limits: Limits) -> bool:
    """Whether a failed attempt's ``error`` ends its model call instead of being retried.

    It does when the error is not retryable, when ``failures`` (the failed attempts of this
    one model call, a summary's or the step's own, this one included) exceed
    ``limits.max_model_retries``, or when the server asked for a wait (``retry_after_s``,
    seconds) longer than ``limits.retry_after_max_s`` (decision 0102). A wait that outlasts
    the run's time budget is not decided here: it stops the run with ``time_budget`` when it
    would be slept.
    """
    if not error.retryable or failures > limits.max_model_retries:
        return True
    cap = limits.retry_after_max_s
    return error.retry_after_s is not None and cap is not None and error.retry_after_s > cap

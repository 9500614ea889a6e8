"""The per-request limits of ``[server]``: ``n``, logprobs and stop sequences.

Each check raises a 400 whose ``param`` is the field and whose message names the config key
to raise, e.g. "`n` is 40; this server allows at most 16 (server.max_n)". The protocol's hard
ceilings (`heron.core.config.MAX_N`, ``MAX_LOGPROBS``) are checked earlier, when decoding.
The queue limits (429) are the engine's: see `heron.core.async_engine.AsyncEngine.add`.
"""

from __future__ import annotations

from heron.core.config import ServerConfig
from heron.server.errors import APIError, bad_request
from heron.server.protocol import SamplingFields

# the fields that ask for top-k alternatives, per token (chat's `logprobs` is a flag)
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")


def check_limits(limits: ServerConfig, req: SamplingFields) -> None:
    """Refuse the first field of ``req`` past its configured limit."""
    check_n(limits, req.n)
    for name in _LOGPROB_FIELDS:
        value = getattr(req, name, None)
        if type(value) is int and value > limits.max_logprobs:
            raise _over(name, f"is {value}", limits.max_logprobs, "max_logprobs")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise _over("stop", f"has {len(stops)} sequences", limits.max_stop_sequences,
                    "max_stop_sequences")
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_length:
            where = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
            raise _over(where, f"is {len(stop)} characters", limits.max_stop_length,
                        "max_stop_length", unit=" characters")


def check_n(limits: ServerConfig, n: int) -> None:
    if n > limits.max_n:
        raise _over("n", f"is {n}", limits.max_n, "max_n")


def _over(param: str, what: str, limit: int, key: str, unit: str = "") -> APIError:
    return bad_request(f"`{param}` {what}; this server allows at most {limit}{unit} "
                       f"(server.{key})", param=param, code="limit_exceeded")

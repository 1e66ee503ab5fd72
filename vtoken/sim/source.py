"""Where the simulator's attention comes from: a synthetic generator or recorded real traces.

Both give, for a *batch* of requests (arrays ``[R, ...]``), what the policies consume:

  * ``prefill(P)``        stats after the prompt's forward (a ``Prefill``, fields named by ``Stat``): Σ
                          attention over the P prompt queries, the last prompt query's attention,
                          unimportance bits of the last ≤64 queries, Σ over the last ≤32 (the observation
                          window; zeros unless asked for, like the bits)
  * ``attention(s, keys)`` attention of the query at logical position ``s`` over logical ``keys``
  * ``key_norm``          per-token key norm ``[R, T]``

No source has keys, so no statistic measured from them (``Stat.REDUNDANCY``, R-KV's): ``check_simulable``
refuses a policy that reads one, by name, instead of replaying zeros.

Attention is what a *full-cache* forward would give (as recorded traces are): the simulator studies
the allocator, so every mode replays the same scores. All math is elementwise or row-sequential, so a
request's numbers do not depend on how many requests share the batch (both engines agree bit for bit).

Synthetic model (knobs in ``SyntheticConfig``)::

    a(s, i) = w_i · r(s - i) / Z(s),   Z(s) = Σ_{j ≤ s} w_j r(s - j)
    r(d) = (1 - ρ) + ρ · exp(-d / τ) for d < 40τ, else (1 - ρ)   (the cut-off changes r by < 5e-18)
    w_i ~ LogNormal(0, σ) (heavy-hitter skew); the first ``sinks`` tokens get w × sink_boost
    key_norm_i = w_i^(-κ) · LogNormal(0, 0.1)   (low-norm keys draw attention: KNorm's premise)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from vtoken.errors import ConfigError
from vtoken.policies.context import HISTORY_BITS, OBSERVATION_WINDOW, Stat

UNSIMULATED = frozenset({Stat.REDUNDANCY})  # statistics of the keys themselves: no source carries keys
RECENCY_CUTOFF = 40  # r(d) drops its decaying term beyond 40·τ tokens (exp(-40) < 5e-18)


def check_simulable(cfg) -> None:
    """Raise ``ConfigError`` when ``cfg``'s policy reads a statistic no source gives (``UNSIMULATED``)."""
    missing = sorted(s.value for s in cfg.measured_stats() & UNSIMULATED)
    if missing:
        raise ConfigError(
            f"policy {cfg.policy!r} cannot be simulated: it reads {', '.join(missing)} (each key's "
            "cosine similarity to the request's other keys), and the simulator's sources hold "
            "attention and key norms but no keys; run it in vLLM (vtoken verify, vtoken bench)"
        )


class Prefill(NamedTuple):
    """Every statistic after the prompt's forward, ``[R, P]`` each, named by ``Stat`` (as ``StepScores``)."""

    accumulated: np.ndarray
    last: np.ndarray
    unimportant: np.ndarray
    window: np.ndarray


RNG_BLOCK = 64  # requests per random stream: a request's numbers never depend on the batch it runs in


def _normals(seed: int, stream: int, first: int, R: int, T: int) -> np.ndarray:
    """Standard normals ``[R, T]`` for requests ``first..first+R-1``, one generator per 64 requests."""
    out = np.empty((R, T))
    b0 = first // RNG_BLOCK
    for b in range(b0, (first + R - 1) // RNG_BLOCK + 1):
        block = np.random.default_rng([seed, stream, b]).standard_normal((RNG_BLOCK, T))
        lo, hi = max(first, b * RNG_BLOCK), min(first + R, (b + 1) * RNG_BLOCK)
        out[lo - first : hi - first] = block[lo - b * RNG_BLOCK : hi - b * RNG_BLOCK]
    return out


def _decayed_cumsum(x: np.ndarray, q: float) -> np.ndarray:
    """y[:, s] = Σ_{j ≤ s} x[:, j] q^(s-j), row by row (blocked: cumsum inside 64-wide blocks + carry)."""
    R, T = x.shape
    b = 64
    nb = -(-T // b)
    xp = np.zeros((R, nb * b))
    xp[:, :T] = x
    t = np.arange(b)
    local = np.cumsum(xp.reshape(R, nb, b) * q ** (-t), axis=2) * q**t
    carry = np.zeros((R, nb))
    for k in range(1, nb):
        carry[:, k] = local[:, k - 1, -1] + q**b * carry[:, k - 1]
    return (local + carry[:, :, None] * q ** (t + 1)).reshape(R, nb * b)[:, :T]


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic attention generator (see module docstring).

    Defaults are calibrated to the SmolLM2 traces in ``vtoken/sim/traces`` (last query of 512 tokens):
    top-10% keys hold ≈0.8 of the mass, the first 4 tokens ≈0.3, the last 32 tokens ≈0.35-0.4.
    """

    sinks: int = 1
    sink_boost: float = 1000.0
    recency_weight: float = 0.98  # ρ: share of r() that decays with distance
    recency_tau: float = 20.0  # τ, in tokens
    hh_sigma: float = 1.5  # σ of the log-normal key importance (heavy-hitter skew)
    knorm_kappa: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 <= self.recency_weight < 1.0:
            raise ValueError(f"recency_weight must be in [0, 1), got {self.recency_weight}")
        if self.recency_tau <= 0 or self.hh_sigma < 0 or self.sink_boost <= 0 or self.sinks < 0:
            raise ValueError(f"invalid synthetic knobs: {self}")


class SyntheticSource:
    """Synthetic attention for ``R`` requests of ``T`` tokens, drawn from ``seed`` (per-request streams)."""

    def __init__(self, cfg: SyntheticConfig, num_requests: int, num_tokens: int, seed: int, first: int = 0):
        self.cfg = cfg
        self.T = num_tokens
        self.num_requests = num_requests
        self._seed, self._first = seed, first
        w = np.exp(cfg.hh_sigma * _normals(seed, 0, first, num_requests, num_tokens))
        w[:, : cfg.sinks] *= cfg.sink_boost
        self.w = w
        rho = cfg.recency_weight
        self.band = int(np.ceil(cfg.recency_tau * RECENCY_CUTOFF))
        d = np.arange(self.band + 1)
        self.decay = np.where(d < self.band, rho * np.exp(-d / cfg.recency_tau), 0.0)  # ρ·exp(-d/τ), cut
        # Z(s) = (1-ρ) W(s) + ρ Σ_j w_j q^(s-j)  (uncut r: differs from the cut r by < 5e-18)
        self.Z = (1.0 - rho) * np.cumsum(w, axis=1) + rho * _decayed_cumsum(w, np.exp(-1.0 / cfg.recency_tau))

    @cached_property
    def key_norm(self) -> np.ndarray:
        """Per-token key norms ``[R, T]`` (drawn on first use: only KNorm reads them)."""
        noise = np.exp(0.1 * _normals(self._seed, 1, self._first, self.num_requests, self.T))
        return self.w ** (-self.cfg.knorm_kappa) * noise

    def attention(self, s: int, keys: np.ndarray) -> np.ndarray:
        """a(s, keys) for keys ``[R, C]`` (logical positions ≤ s), elementwise."""
        return self._attn(np.take_along_axis(self.w, keys, axis=1), self.Z[:, s : s + 1], s, keys)

    def attention_row(self, r: int, s: int, keys: np.ndarray) -> np.ndarray:
        """a(s, keys) for request ``r`` only; bit-identical to its row of ``attention``."""
        return self._attn(self.w[r, keys], self.Z[r, s], s, keys)

    def _attn(self, w: np.ndarray, z, s: int, keys: np.ndarray, band_start: int = 0) -> np.ndarray:
        """Elementwise a(s, keys). Columns before ``band_start`` are known to be older than the recency
        band (a pure speed-up: they get r = 1-ρ either way)."""
        out = w * (1.0 - self.cfg.recency_weight)
        out[..., band_start:] += w[..., band_start:] * self.decay[np.minimum(s - keys[..., band_start:], self.band)]
        out /= z
        return out

    def prefill(self, P: int, need_bits: bool, need_window: bool = False) -> Prefill:
        rho = self.cfg.recency_weight
        inv_z = 1.0 / self.Z[:, :P]
        H = np.cumsum(inv_z[:, ::-1], axis=1)[:, ::-1]  # Σ_{s≥i} 1/Z(s)
        G = _decayed_cumsum(inv_z[:, ::-1], np.exp(-1.0 / self.cfg.recency_tau))[:, ::-1]  # Σ_{s≥i} q^(s-i)/Z(s)
        total = self.w[:, :P] * ((1.0 - rho) * H + rho * G)
        keys = np.broadcast_to(np.arange(P), (self.w.shape[0], P))
        last = self.attention(P - 1, keys)
        bits = self._bits(P, keys) if need_bits else np.zeros(total.shape, np.uint64)
        window = np.zeros(total.shape)
        if need_window:
            for s in range(max(P - OBSERVATION_WINDOW, 0), P):  # the observation window, oldest query first
                window[:, : s + 1] += self.attention(s, keys[:, : s + 1])
        return Prefill(total, last, bits, window)

    def _bits(self, P: int, keys: np.ndarray) -> np.ndarray:
        bits = np.zeros(keys.shape, np.uint64)
        for j, s in enumerate(range(P - 1, max(P - HISTORY_BITS, 0) - 1, -1)):  # bit j = j-th newest query
            low = (self.attention(s, keys) < 1.0 / (s + 1)) & (keys <= s)
            bits |= low.astype(np.uint64) << np.uint64(j)
        return bits


class TraceSource:
    """Recorded attention: ``attn[r]`` is a lower-triangular ``[T, T]`` matrix (mean over heads/layers)."""

    def __init__(self, attn: np.ndarray, key_norm: np.ndarray):
        self.attn = np.asarray(attn, dtype=np.float64)
        self.key_norm = np.asarray(key_norm, dtype=np.float64)
        self.T = self.attn.shape[-1]
        self.num_requests = self.attn.shape[0]

    def attention(self, s: int, keys: np.ndarray) -> np.ndarray:
        return np.take_along_axis(self.attn[:, s, :], keys, axis=1)

    def attention_row(self, r: int, s: int, keys: np.ndarray) -> np.ndarray:
        return self.attn[r, s, keys]

    def prefill(self, P: int, need_bits: bool, need_window: bool = False) -> Prefill:
        total = self.attn[:, :P, :P].sum(axis=1)
        last = self.attn[:, P - 1, :P].copy()
        bits = np.zeros(total.shape, np.uint64)
        if need_bits:
            cols = np.arange(P)
            for j, s in enumerate(range(P - 1, max(P - HISTORY_BITS, 0) - 1, -1)):
                low = (self.attn[:, s, :P] < 1.0 / (s + 1)) & (cols <= s)
                bits |= low.astype(np.uint64) << np.uint64(j)
        window = np.zeros_like(total)
        if need_window:
            window = self.attn[:, max(P - OBSERVATION_WINDOW, 0) : P, :P].sum(axis=1)
        return Prefill(total, last, bits, window)

"""``run_simulation``: configuration in, the ``vtoken simulate`` JSON contract out."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from vtoken.core.config import Granularity, Mode, Scope, Trigger, VTokenConfig
from vtoken.errors import ConfigError
from vtoken.sim.exact import simulate_exact
from vtoken.sim.fast import simulate_fast
from vtoken.sim.result import SimTally, whole_pool
from vtoken.sim.source import SyntheticConfig, SyntheticSource, TraceSource, check_simulable

ENGINES = ("fast", "exact")
# the keys of the dict ``run_simulation`` returns (``vtoken simulate``'s JSON, ``vtoken bench sim-scale``'s
# ``result``)
RESULT_KEYS = frozenset(
    {
        "policy",
        "budget",
        "block_size",
        "requests",
        "prompt_len",
        "gen_len",
        "seed",
        "sinks",
        "recent",
        "trigger",
        "granularity",
        "engine",
        "workers",
        "source",
        "packing_bound_mean",
        "live_tokens_mean",
        "modes",
        "seconds",
    }
)
# and, for a hybrid model's shape (``window`` set), the whole pool: ``result.whole_pool``
HYBRID_KEYS = frozenset({"window", "window_groups", "pool"})


@dataclass(frozen=True)
class SimConfig:
    """A simulation: the vToken settings (every mode runs, so ``vtoken.mode`` is ignored; ``vtoken.seed``
    also seeds the synthetic attention) plus the workload and how to run it. ``of(**kw)`` takes the
    settings' keys flat, as the CLI passes them."""

    vtoken: VTokenConfig = VTokenConfig(budget=0.2, block_size=16, scope=Scope.ALL)
    prompt_len: int = 512
    gen_len: int = 256
    requests: int = 64
    engine: str = "fast"
    chunk: int = 256  # requests per batch in the fast engine (bounds memory)
    workers: int = 1  # processes for the fast engine (chunks run in parallel)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    traces: Path | None = None  # recorded attention (.npz from `vtoken trace record`) instead of synthetic
    window: int | None = None  # a hybrid model: its sliding-window layers' window (the simulated layers are
    window_groups: int = 0  # its full-attention group; this many sliding-window groups of blocks beside it)

    def __post_init__(self) -> None:
        for name in ("prompt_len", "gen_len", "requests", "chunk", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; valid engines: {', '.join(ENGINES)}")
        if (self.window is None) != (self.window_groups == 0) or (
            self.window is not None
            and (
                isinstance(self.window, bool)
                or not isinstance(self.window, int)
                or self.window < 1
                or self.window_groups < 1
            )
        ):
            raise ConfigError(
                f"window and window-groups go together, both positive (a hybrid model's sliding "
                f"window and its sliding-window KV cache groups), got {self.window!r} and "
                f"{self.window_groups!r}"
            )
        if self.engine == "fast" and self.vtoken.granularity is Granularity.BLOCK:
            raise ConfigError("granularity 'block' runs on the exact engine only: pass --engine exact")
        if self.engine == "fast" and self.vtoken.keep_mass is not None:  # requests keep different counts
            raise ConfigError("keep_mass runs on the exact engine only: pass --engine exact")
        if self.vtoken.trigger is Trigger.PRESSURE:  # the simulator has no shared pool to run short
            raise ConfigError(
                "trigger 'pressure' evicts only when vLLM's shared KV pool runs short; the "
                "simulator gives every request its own memory: use trigger 'step' or 'block'"
            )
        check_simulable(self.vtoken)

    @classmethod
    def of(cls, **kwargs) -> SimConfig:
        """``SimConfig.of(policy="h2o", budget=0.2, prompt_len=512, ...)``: ``VTokenConfig`` keys go to
        ``vtoken`` (over the default above), the rest to the simulation. Raises ``ConfigError``."""
        given = {k: kwargs.pop(k) for k in VTokenConfig.keys() if k in kwargs}
        default = cls.__dataclass_fields__["vtoken"].default
        return cls(vtoken=replace(default, **given, mode=Mode.REPACK), **kwargs)


def _trace_sources(cfg: SimConfig):
    from vtoken.sim.record import load_traces

    traces = load_traces(cfg.traces)
    T = cfg.prompt_len + cfg.gen_len
    usable = [t for t in traces if t.attn.shape[0] >= T]
    if not usable:
        longest = max(t.attn.shape[0] for t in traces)
        raise ConfigError(f"prompt-len + gen-len = {T} exceeds the longest recorded trace ({longest} tokens)")
    for start in range(0, cfg.requests, cfg.chunk):
        idx = [usable[(start + i) % len(usable)] for i in range(min(cfg.chunk, cfg.requests - start))]
        attn = np.stack([t.attn[:T, :T] for t in idx])
        knorm = np.stack([t.key_norm[:T] for t in idx])
        yield start, TraceSource(attn, knorm)


def _synthetic_source(cfg: SimConfig, start: int) -> SyntheticSource:
    n = min(cfg.chunk, cfg.requests - start)
    return SyntheticSource(cfg.synthetic, n, cfg.prompt_len + cfg.gen_len, cfg.vtoken.seed, first=start)


def _fast_synthetic_chunk(args: tuple[SimConfig, int]) -> SimTally:
    cfg, start = args
    source = _synthetic_source(cfg, start)
    return simulate_fast(cfg.vtoken, source, cfg.prompt_len, cfg.gen_len, first_request=start)


def _tallies(cfg: SimConfig):
    """Yield (requests done, partial tally) per chunk, in parallel where asked."""
    core = cfg.vtoken
    if cfg.traces is None and cfg.engine == "fast":
        starts = [(cfg, s) for s in range(0, cfg.requests, cfg.chunk)]
        if cfg.workers > 1:
            with mp.get_context("fork").Pool(cfg.workers) as pool:
                for part in pool.imap_unordered(_fast_synthetic_chunk, starts):
                    yield part.requests, part
        else:
            for a in starts:
                part = _fast_synthetic_chunk(a)
                yield part.requests, part
        return
    sources = (
        _trace_sources(cfg)
        if cfg.traces
        else ((s, _synthetic_source(cfg, s)) for s in range(0, cfg.requests, cfg.chunk))
    )
    for start, source in sources:
        if cfg.engine == "fast":
            part = simulate_fast(core, source, cfg.prompt_len, cfg.gen_len, first_request=start)
        else:
            part = simulate_exact(core, source, cfg.prompt_len, cfg.gen_len, first_request=start)
        yield part.requests, part


def run_simulation(cfg: SimConfig, on_requests: Callable[[int], None] | None = None) -> tuple[dict, SimTally]:
    """Run every reclamation mode on the same victims; returns (contract JSON dict: ``RESULT_KEYS``,
    tally)."""
    t0 = time.perf_counter()
    tally = SimTally(cfg.gen_len)
    for n, part in _tallies(cfg):
        _merge(tally, part)
        if on_requests:
            on_requests(n)
    seconds = time.perf_counter() - t0
    vt = cfg.vtoken.to_dict()
    out = {
        "policy": vt["policy"],
        "budget": vt["budget"],
        "block_size": vt["block_size"],
        "requests": cfg.requests,
        "prompt_len": cfg.prompt_len,
        "gen_len": cfg.gen_len,
        "seed": vt["seed"],
        "sinks": vt["sinks"],
        "recent": vt["recent"],
        "trigger": vt["trigger"],
        "granularity": vt["granularity"],
        "engine": cfg.engine,
        "workers": cfg.workers,
        "source": str(cfg.traces) if cfg.traces else "synthetic",
        **tally.summary(),
        "seconds": round(seconds, 3),
    }
    if cfg.window is not None:
        out.update(
            window=cfg.window,
            window_groups=cfg.window_groups,
            pool=whole_pool(out, cfg.prompt_len, cfg.gen_len, vt["block_size"], cfg.window, cfg.window_groups),
        )
    return out, tally


def _merge(into: SimTally, part: SimTally) -> None:
    into.requests += part.requests
    into.packing_per_step_sum += part.packing_per_step_sum
    into.live_per_step_sum += part.live_per_step_sum
    for m, t in part.modes.items():
        dst = into.modes[m]
        dst.per_step_sum += t.per_step_sum
        dst.peaks.extend(t.peaks)
        dst.moves += t.moves
        dst.moves_lower_bound += t.moves_lower_bound

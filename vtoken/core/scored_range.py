"""Which row slots a step must score: ``[first_scored, seq_len)``, never the tokens that stay forever.

The attention statistics (``vtoken.core.step_stats``) are read by a policy only for evictable tokens, and per
token, except where a policy mixes neighbours or the whole live set. A token that is *never* evictable for
the request's whole life needs none of them, so the worker need not accumulate, copy back or fold them:

  * the sinks, logical ``0 .. sinks-1``;
  * the kept prompt (``VTokenConfig.kept_prompt``) when it starts at 0 (``scope: generated``: the whole
    prompt; ``scope: all`` with ``prompt_tail`` ≥ the prompt).

Together they are a logical prefix ``[0, L)``. Invariant: those tokens sit in row slots ``0 .. L-1`` for the
table's whole life (they are placed first, in order, are never evicted, so no hole ever appears below
``L`` and the repack planner only moves tokens from slots ≥ ``live`` ≥ ``L``; copy-on-write keeps offsets).
So the same bound is a row slot, and every token that is or will become evictable sits at a slot ≥ ``L``
from its birth: it keeps its whole history.

Not skipped, because they *become* evictable later: the recent window, tokens of steps in flight, shared
prefix blocks (a block stops being shared when the other request ends). The softmax still normalises over
every key; only what is accumulated, transferred and folded is restricted.

Reach: span pooling (``score_pool``) ranks an evictable token by its neighbours' scores within that logical
distance, so the range starts ``score_pool`` earlier. Policies whose score of one token depends on the whole
live set keep the full range (``first = 0``): R-KV (``redundancy``, softmax over all live tokens and
renormalised pooled importance) and SnapKV (``window``: its ranks add the maximum pooled score over every
live token). ``trigger: pressure`` keeps it full as well: its batch-wide order divides a request's scores by
their total over every live token (``vtoken.core.batch.pressure``). The engine setting ``scores: always``
(statistics for their own sake) keeps it full too.
"""

from __future__ import annotations

from vtoken.core.config import Trigger, VTokenConfig
from vtoken.policies.context import Stat

WHOLE_SET_STATS = frozenset({Stat.REDUNDANCY, Stat.WINDOW})  # a policy reading these sees every live token


def protected_prefix(cfg: VTokenConfig, prompt_len: int) -> int:
    """``L``: logical tokens ``0 .. L-1`` are never evictable for a request with this config and prompt
    length (see the module docstring). Pure."""
    lo, hi = cfg.kept_prompt(prompt_len)
    return max(cfg.sinks, hi) if lo == 0 and hi > lo else cfg.sinks


def first_scored(cfg: VTokenConfig, prompt_len: int, full: bool = False) -> int:
    """The first row slot whose attention statistics a step must score (0: the whole row): the protected
    prefix less the policy's pooling reach; 0 for a policy in ``WHOLE_SET_STATS``, under ``trigger:
    pressure`` or when ``full`` (``scores: always``). Pure; the caller clips it to the step's ``seq_len``
    (nothing to score when ``first ≥ seq_len``)."""
    if full or cfg.trigger is Trigger.PRESSURE or cfg.policy_class.needs & WHOLE_SET_STATS:
        return 0
    return max(protected_prefix(cfg, prompt_len) - cfg.score_pool, 0)

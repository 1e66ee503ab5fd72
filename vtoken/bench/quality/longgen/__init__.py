"""``vtoken bench longgen``: a long-generation quality yardstick that can fail.

Human-written text the project did not write (``texts``: read at run time from installed packages) is
the teacher. Each window's first ``prompt`` tokens are the prompt; its next ``continuation`` tokens are
*decoded* by the real engine, one token per step, with a logits processor that forces the teacher's token
(``vtoken.vllm.offline.teacher``), so the policy evicts after every token exactly as it does while decoding. The
engine's trace (which key each query could see) is then replayed through the masked Hugging Face
reference (one forward per window), which gives the full-vocabulary distributions of the point and of the
full cache at every continuation position::

    window   [ prompt (P) | continuation (N) ]         per continuation position:
    engine    prefill P,   then N decode steps,        - log p(real next token)  -> perplexity ratio
              forced token = the real text's            - KL(full || point), whole vocabulary
    replay    one forward, row q sees the keys the      - top-1 agreement with the full cache
              engine let query q see

``rule`` holds the parity rule (stated in docs/quality.md before any point was measured) and the paired
bootstrap; ``run`` the engine and the replay; ``cli`` the command.
"""

"""Human-written text the project did not write, read at run time from what is installed (pure reads).

=============================  ======================================  ==========================================
source                         where it comes from                     licence
=============================  ======================================  ==========================================
``pydoc:<topic>``              CPython's ``pydoc_data.topics``: the    PSF License 2.0 (CPython's)
                               Language Reference sections ``help()``
                               shows (79 topics, ≈ 465 k characters)
``licenses:<name>``            Debian's ``/usr/share/common-licenses``  each text's own terms: verbatim copies
                               (package ``base-files``): GPL-3,         permitted (GPL, GFDL, MPL, Apache,
                               Apache-2.0, MPL-2.0, GFDL-1.3,           Artistic); CC0-1.0 is public domain
                               Artistic, CC0-1.0
=============================  ======================================  ==========================================

Every document is cut into consecutive, non-overlapping windows of the requested length (never across two
documents); ``windows`` draws ``count`` of them without replacement from a seeded generator. A machine
without ``/usr/share/common-licenses`` (not Debian) has fewer windows; the report names every window and
the SHA-256 of every document it read, so two runs are comparable only when those agree.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from vtoken.bench.quality.tasks import TextWindow as Window  # ``prompt_ids``: the whole window here

LICENSES_DIR = Path("/usr/share/common-licenses")
# GPL-2 / LGPL-* repeat most of GPL-3's or each other's text, GPL-1 / MPL-1.1 are older versions: left out
LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0")


def documents() -> dict[str, str]:
    """``{source: text}`` of every document found (module doc), in a fixed order. Reads files only."""
    from pydoc_data.topics import topics

    docs = {f"pydoc:{k}": topics[k] for k in sorted(topics)}
    for name in LICENSES:
        path = LICENSES_DIR / name
        if path.is_file():
            docs[f"licenses:{name}"] = path.read_text(encoding="utf-8")
    return docs


def digests(docs: dict[str, str]) -> dict[str, str]:
    """SHA-256 (hex, first 16 digits) of each document's text."""
    return {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in docs.items()}


def all_windows(tokenizer, length: int, docs: dict[str, str]) -> list[Window]:
    """Every non-overlapping ``length``-token window of every document, in document order (pure)."""
    if length < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {length}")
    out = []
    for source, text in docs.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for offset in range(0, len(ids) - length + 1, length):
            out.append(Window(f"{source}@{offset}", source, offset, tuple(ids[offset : offset + length])))
    return out


def windows(tokenizer, length: int, count: int, seed: int, docs: dict[str, str] | None = None) -> list[Window]:
    """``count`` windows of ``length`` tokens drawn without replacement (seeded); ``ValueError`` naming how
    many exist when fewer than ``count`` do."""
    pool = all_windows(tokenizer, length, documents() if docs is None else docs)
    if count > len(pool):
        raise ValueError(f"{count} windows of {length} tokens requested; the installed texts hold {len(pool)}")
    return random.Random(seed).sample(pool, count)

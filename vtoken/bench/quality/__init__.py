"""``vtoken bench`` for what eviction costs in answers: the quality bench, RULER-style tasks, the yardstick and
``longgen/`` (the long-generation yardstick, codegen). Mounted by ``vtoken/bench/cli.py`` (through
``quality/cli.py``); ``scripts/results_doc.py`` and the tests import its tables and pieces."""

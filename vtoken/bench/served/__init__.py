"""``vtoken bench serve`` and ``vtoken bench soak``: the served stack (``vtoken serve``) measured over HTTP,
its runs summarised and plotted. Mounted by ``vtoken/bench/cli.py`` (through ``served/cli.py``);
``scripts/results_doc.py``, ``scripts/admission_trace.py`` and the tests import its pieces."""

"""``vtoken bench`` on one in-process engine or the engine-free core: sim-scale, retained, overhead, capacity,
prefix, score-host, kernels. Mounted by ``vtoken/bench/cli.py`` (through ``engine/cli.py``); otherwise only
the tests import it."""

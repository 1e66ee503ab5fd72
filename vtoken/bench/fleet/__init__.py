"""``vtoken bench fleet``: N replicas on paper (the workload, the routers, the simulation, measured step
times). Mounted by ``vtoken/bench/cli.py`` (through ``fleet/cli.py``); otherwise only the tests import it."""

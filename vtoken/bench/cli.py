"""``vtoken bench …``: benchmarks that print what they measured as JSON, with the command that produced it.

Speed and memory targets live here, compared side by side in one run, never as timed tests. Each family
declares its commands in its own ``cli.py``; this file only mounts them::

    engine/   sim-scale retained overhead capacity prefix score-host kernels   (one engine or none)
    quality/  quality yardstick longgen codegen longgen-figure trade-figure    (answers, on the yardstick)
    served/   serve soak                                                       (vtoken serve over HTTP)
    fleet/    fleet                                                            (N replicas, simulated)
"""

from __future__ import annotations

import typer

from vtoken.bench.engine.cli import app as engine_app
from vtoken.bench.fleet.cli import app as fleet_app
from vtoken.bench.quality.cli import app as quality_app
from vtoken.bench.served.cli import app as served_app

bench_app = typer.Typer(help="Benchmarks (JSON out, with the command that produced it).", no_args_is_help=True)
for family in (engine_app, quality_app, served_app, fleet_app):
    bench_app.registered_commands.extend(family.registered_commands)

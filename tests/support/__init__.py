"""Helpers shared by the test modules (tests/unit, tests/integration, tests/e2e, tests/docs), imported as
``from support.engine import small_pool_engine``: pyproject's ``pythonpath = ["tests"]`` puts tests/ on
``sys.path``. Test modules import helpers only from here, never from one another."""

"""tests/gpu and scripts/gpu_check.py import on a machine that has only torch, triton, numpy and pytest.

Simulated in a subprocess: vLLM, typer, pydantic, ray, rich and transformers cannot be imported, the
editable install of vtoken is hidden (its import finder and path hook removed, the checkout not on
``sys.path``), and the working directory is elsewhere; pytest's plugins are not auto-loaded. Collection of
tests/gpu must find every test (it cannot run them: no GPU here) and the GPU check's module must load.
"""

from __future__ import annotations

import os
import subprocess
import sys

from support.paths import ROOT

ISOLATE = """
import importlib.abc, os, runpy, sys
BLOCK = ("vllm", "typer", "pydantic", "ray", "rich", "transformers")
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ImportError("not installed here: " + name)
def editable(obj):
    return "editable" in (obj if isinstance(obj, type) else type(obj)).__module__.lower()
sys.meta_path[:] = [Blocker()] + [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path_importer_cache.clear()
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd(), ROOT)]
try:
    import vtoken
    sys.exit("vtoken is importable without the checkout: the isolation failed")
except ImportError:
    pass
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    isolate = ISOLATE.replace("ROOT)", repr(str(ROOT)) + ")")
    return subprocess.run(
        [sys.executable, "-c", isolate + code], capture_output=True, text=True, timeout=300, cwd="/tmp", env=env
    )


def test_tests_gpu_collect_without_vllm_or_the_project_installed():
    code = (
        f"import pytest; sys.exit(pytest.main([{str(ROOT / 'tests/gpu')!r}, '--collect-only', '-q', "
        "'-p', 'no:cacheprovider']))"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_warmups_compile_every_variant_the_steps_use" in proc.stdout
    assert "tests collected" in proc.stdout and "error" not in proc.stdout.lower()


def test_gpu_check_loads_without_vllm_or_the_project_installed():
    code = f"runpy.run_path({str(ROOT / 'scripts/gpu_check.py')!r}, run_name='not_main'); print('loaded')"
    proc = _run(code)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]

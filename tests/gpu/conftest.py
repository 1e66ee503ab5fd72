"""tests/gpu runs where only torch, triton, numpy and pytest are installed (the GPU machine: no vLLM, the
project not installed): the repository root goes on ``sys.path`` so ``vtoken.kernels`` imports from the
checkout, as ``scripts/gpu_check.py`` does. Nothing else changes for the session."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

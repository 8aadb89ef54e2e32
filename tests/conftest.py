import os
import pathlib
import sys

import pytest
import torch

# helpers.py lives here, above the layer folders: pytest's default import mode puts only each
# test file's own folder on sys.path.
TESTS = str(pathlib.Path(__file__).parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Without a GPU the Triton kernels run under the interpreter; this must be set before triton.jit
# decorates them. omniattn.attention sends CPU tensors to the kernels while it is set.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gluon_calls(monkeypatch) -> list:
    """Records the launches of the Gluon forward ("fwd") and backward ("bwd", either kernel)."""
    from omniattn import passes

    calls = []
    forward, backward = passes.hopper_forward, passes.hopper_backward
    wide = passes.hopper_backward_wide
    monkeypatch.setattr(passes, "hopper_forward", lambda *a: calls.append("fwd") or forward(*a))
    monkeypatch.setattr(passes, "hopper_backward", lambda *a: calls.append("bwd") or backward(*a))
    monkeypatch.setattr(passes, "hopper_backward_wide",
                        lambda *a: calls.append("bwd") or wide(*a))
    return calls


@pytest.fixture(autouse=True)
def _fresh_call_plans():
    """Every test starts without call plans: a plan recorded under another test's patched
    configs or kernels would replay them."""
    from omniattn.runtime import call_plans

    call_plans.clear()
    yield
    call_plans.clear()

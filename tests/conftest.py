import os

import torch

# Without a GPU the Triton kernels run under the interpreter; this must be set before triton.jit
# decorates them. omniattn.attention sends CPU tensors to the kernels while it is set.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

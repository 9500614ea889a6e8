"""What this plugin registers with heron. Imported at start-up: keep it cheap.

The loader is named by a string, so the model code is imported only when a GPT-2
checkpoint is actually loaded.
"""

from heron.core import FamilySpec, hookimpl
from heron_gpt2.ops import GELU_KERNEL


@hookimpl
def heron_register_families(register):
    register(FamilySpec(
        name="gpt2",
        loader="heron_gpt2.loader:load",
        architectures=("GPT2LMHeadModel",),
    ))


@hookimpl
def heron_register_kernels(register):
    # one variant per element type: float32, float16, bfloat16
    register(GELU_KERNEL, ["gelu_tanh_kernel"], [{"HERON_DTYPE": code} for code in (0, 1, 2)])

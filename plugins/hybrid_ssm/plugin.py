"""Registers the hybrid_ssm family (Mamba2, Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1) and
its Mamba2 kernels."""

from heron.core.family import FamilySpec
from heron.core.hookspecs import hookimpl
from heron.plugins.hybrid_ssm.config import ARCHITECTURES

_DTYPES = [{"HERON_DTYPE": code} for code in (0, 1, 2)]  # float32, float16, bfloat16


@hookimpl
def heron_register_families(register):
    register(FamilySpec(
        name="hybrid_ssm",
        loader="heron.plugins.hybrid_ssm.loader:load",
        architectures=ARCHITECTURES,
    ))


@hookimpl
def heron_register_kernels(register):
    from heron.plugins.hybrid_ssm.cuda import CONV, NORM, SSM
    register(CONV, ["conv1d_decode_kernel", "conv1d_prefill_kernel", "conv1d_window_kernel"],
             _DTYPES)
    register(SSM, ["ssm_decode_kernel", "ssd_chunk_state_kernel", "ssd_state_passing_kernel",
                   "ssd_chunk_scan_kernel"], _DTYPES)
    register(NORM, ["gated_rms_norm_kernel"], _DTYPES)

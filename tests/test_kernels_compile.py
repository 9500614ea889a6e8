"""Every registered CUDA kernel compiles for sm_80 and sm_90 without a GPU (NVRTC or nvcc)."""

from __future__ import annotations

import io

import pytest

from heron.core import kernel_check, kernels
from heron.core.kernel_check import check_kernels, compiler_available
from heron.core.kernels import KernelFile, load_source

needs_compiler = pytest.mark.skipif(
    compiler_available() is None,
    reason="neither NVRTC (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12) nor nvcc is available")

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def core_results():
    return check_kernels(ARCHS)


@needs_compiler
def test_every_registered_kernel_compiles(core_results):
    results = core_results
    files = {r.file for r in results}
    assert {f.split("/")[-1] for f in files} >= {
        "norm.cu", "activation.cu", "rotary.cu", "cache.cu", "attention_decode.cu",
        "attention_prefill.cu", "attention_prefill_mma.cu"}
    assert len(results) == len(files) * len(ARCHS)
    failed = [r for r in results if not r.ok]
    assert not failed, kernel_check.format_check(failed)


def _broken(tmp_path, body: str, header: str | None = None) -> KernelFile:
    if header is not None:
        (tmp_path / "helper.cuh").write_text(header)
    path = tmp_path / "broken.cu"
    path.write_text(body)
    return KernelFile(path, ["k"], [{}])


@needs_compiler
def test_syntax_error_reports_file_and_line(tmp_path):
    entry = _broken(tmp_path, 'extern "C" __global__ void k(float* x) {\n'
                              "  x[0] = 1.0f\n"          # line 2: missing semicolon
                              "}\n")
    (result,) = check_kernels(("sm_90",), files=[entry])
    assert not result.ok
    assert "broken.cu" in result.message
    assert "(2)" in result.message or "(3)" in result.message or ":3" in result.message


@needs_compiler
def test_error_lines_survive_inlined_includes(tmp_path):
    """Line numbers after an inlined header, and inside it, are the original ones."""
    entry = _broken(tmp_path,
                    '#include "helper.cuh"\n'
                    'extern "C" __global__ void k(float* x) {\n'
                    "  x[0] = helper();\n"
                    "  undeclared_name = 1;\n"   # line 4
                    "}\n",
                    header="__device__ float helper() { return 1.f; }\n")
    (result,) = check_kernels(("sm_90",), files=[entry])
    assert not result.ok
    assert "broken.cu(4)" in result.message or "broken.cu:4" in result.message, result.message

    entry = _broken(tmp_path, '#include "helper.cuh"\nextern "C" __global__ void k() {}\n',
                    header="\n__device__ float helper() { return nope; }\n")  # header line 2
    (result,) = check_kernels(("sm_90",), files=[entry])
    assert not result.ok
    assert "helper.cuh(2)" in result.message or "helper.cuh:2" in result.message, result.message


@needs_compiler
def test_registered_name_missing_from_source_fails(tmp_path):
    path = tmp_path / "ok.cu"
    path.write_text('extern "C" __global__ void present(float* x) { x[0] = 1.f; }\n')
    (result,) = check_kernels(("sm_80",), files=[KernelFile(path, ["present", "absent"], [{}])])
    assert not result.ok and "absent" in result.message


@needs_compiler
def test_defines_reach_the_compiler(tmp_path):
    path = tmp_path / "defs.cu"
    path.write_text('#if WIDTH != 4\n#error "WIDTH must be 4"\n#endif\n'
                    'extern "C" __global__ void k(float* x) { x[0] = WIDTH; }\n')
    good, bad = KernelFile(path, ["k"], [{"WIDTH": 4}]), KernelFile(path, ["k"], [{"WIDTH": 5}])
    assert check_kernels(("sm_90",), files=[good])[0].ok
    result = check_kernels(("sm_90",), files=[bad])[0]
    assert not result.ok and "WIDTH must be 4" in result.message


@needs_compiler
def test_a_compile_that_passed_is_remembered_until_its_inputs_change(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_KERNEL_CACHE", str(tmp_path))
    compiles = []
    for name in ("_compile_nvcc", "_compile_nvrtc"):
        compile_ = getattr(kernel_check, name)
        monkeypatch.setattr(kernel_check, name,
                            lambda *a, compile_=compile_: compiles.append(a) or compile_(*a))
    path = tmp_path / "k.cu"
    path.write_text('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n')

    def check(names=("k",)) -> bool:
        return check_kernels(("sm_90",), files=[KernelFile(path, list(names), [{}])])[0].ok

    assert check() and check() and len(compiles) == 1  # the second is remembered
    path.write_text('extern "C" __global__ void k(float* x) { x[0] = 2.0f; }\n')
    assert check() and len(compiles) == 2
    # another kernel name is other inputs; a failure is not remembered
    assert not check(["absent"]) and not check(["absent"]) and len(compiles) == 4


@needs_compiler
def test_run_check_prints_one_line_per_file_and_arch(core_results, monkeypatch):
    monkeypatch.setattr(kernel_check, "check_kernels", lambda archs: core_results)  # compiled once
    out = io.StringIO()
    assert kernel_check.run_check(ARCHS, out=out) == 0
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith(("ok", "FAIL"))]
    assert len(lines) == len(kernels.registered_kernel_files()) * len(ARCHS)


def test_load_source_inlines_quoted_includes_once(tmp_path):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "main.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include <cstdio>\nint m;\n')
    text = load_source(tmp_path / "main.cu")
    assert text.count("int b;") == 1 and "int a;" in text and "#include <cstdio>" in text
    assert f'#line 3 "{tmp_path / "main.cu"}"' in text  # back in main.cu after line 2


def test_quoted_include_falls_back_to_core_headers(tmp_path):
    """A plugin's kernel includes core's ``common.cuh`` by name."""
    (tmp_path / "plugin.cu").write_text('#include "common.cuh"\nint p;\n')
    text = load_source(tmp_path / "plugin.cu")
    assert f'#line 1 "{kernels.HEADER_DIR / "common.cuh"}"' in text and "int p;" in text


def test_missing_include_is_reported(tmp_path):
    (tmp_path / "main.cu").write_text('#include "nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nope.cuh"):
        load_source(tmp_path / "main.cu")


def test_register_merges_names_and_define_sets(tmp_path):
    path = tmp_path / "k.cu"
    path.write_text("")
    try:
        kernels.register_kernel_file(path, ["a"], {"X": 1})
        entry = kernels.register_kernel_file(path, ["a", "b"], [{"X": 1}, {"X": 2}])
        assert entry.kernel_names == ["a", "b"]
        assert entry.define_sets == [{"X": 1}, {"X": 2}]
    finally:
        kernels._REGISTRY.pop(path.resolve(), None)

"""The default model in the forms the peers serve, written once next to the GGUF.

- ``hf_dir``: an HF directory (safetensors + tokenizer) of the dequantized GGUF, through
  transformers' own GGUF loader, for vLLM.
- ``hf_dir_without_eos``: the same directory (linked) with no EOS in its generation config,
  for servers that have no ``ignore_eos`` (``transformers serve``);
- ``f32_gguf``: the same GGUF with every tensor dequantized to F32 (names, metadata and
  tokenizer unchanged), so llama.cpp computes at heron's precision;
- ``requantized_gguf``: the same GGUF requantized by llama.cpp's own quantizer to another
  file type (Q4_K_M: its mix of types per tensor), for both to serve.

    python -m bench.peers.models   # prints both paths
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np


def hf_dir(gguf_path: Path) -> Path:
    out = gguf_path.with_suffix(".hf")
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tmp = out.with_suffix(".tmp")
    AutoTokenizer.from_pretrained(gguf_path.parent, **kw).save_pretrained(tmp)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    # A GGUF-loaded model refuses to save; a plain copy of its dequantized weights does not.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def hf_dir_without_eos(gguf_path: Path) -> Path:
    source = hf_dir(gguf_path)
    out = gguf_path.with_suffix(".no-eos.hf")
    if out.exists():
        return out
    tmp = out.with_suffix(".tmp")
    tmp.mkdir()
    for f in source.iterdir():
        if f.name != "generation_config.json":
            (tmp / f.name).symlink_to(f)
    config = json.loads((source / "generation_config.json").read_text())
    config["eos_token_id"] = None
    (tmp / "generation_config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def f32_gguf(gguf_path: Path) -> Path:
    out = gguf_path.with_name(gguf_path.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if out.exists():
        return out
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(0)  # ALL_F32
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        writer.add_key_value(name, f.contents(), vtype, sub)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        # The reader gives numpy's (reversed) shape; the writer takes the same convention.
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]),
                          raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


# ggml's llama_ftype numbers (llama.h)
FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17}


class _QuantizeParams(ctypes.Structure):
    """llama.h's ``llama_model_quantize_params`` at llama-cpp-python 0.3.36
    (setup_llamacpp.sh's pin)."""

    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int),
                ("output_tensor_type", ctypes.c_int), ("token_embedding_type", ctypes.c_int),
                ("allow_requantize", ctypes.c_bool), ("quantize_output_tensor", ctypes.c_bool),
                ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool),
                ("imatrix", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
                ("tt_overrides", ctypes.c_void_p), ("prune_layers", ctypes.c_void_p),
                ("max_buf_size", ctypes.c_size_t)]


def requantized_gguf(gguf_path: Path, file_type: str, libllama: Path) -> Path:
    """``gguf_path`` requantized to ``file_type`` (`FILE_TYPES`) by ``llama_model_quantize``
    of ``libllama``: llama.cpp's choice of type per tensor (Q4_K_M: Q4_K, Q6_K for some
    layers' attn_v and ffn_down, and their stand-ins Q5_0 and Q8_0 where rows are not whole
    256-value blocks). From the default model's Q4_1 values: a file to time, not to judge
    quality by."""
    out = gguf_path.with_name(gguf_path.stem.rsplit(".", 1)[0] + f".{file_type}.gguf")
    if out.exists():
        return out
    if not libllama.exists():
        raise FileNotFoundError(f"{libllama} is missing: run bench/peers/setup_llamacpp.sh")
    lib = ctypes.CDLL(str(libllama))
    lib.llama_model_quantize_default_params.restype = _QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.POINTER(_QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    lib.llama_backend_init()
    params = lib.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    if lib.llama_model_quantize(str(gguf_path).encode(), str(tmp).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {gguf_path} to {file_type}")
    tmp.rename(out)
    return out


def main() -> None:
    from heron.core.default_model import ensure_default_model

    path = ensure_default_model()
    print(hf_dir(path))
    print(hf_dir_without_eos(path))
    print(f32_gguf(path))


if __name__ == "__main__":
    main()

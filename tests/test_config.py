"""Configuration files: defaults agree with the Structs; bad input names file and key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from heron.core.config import Config, ConfigError, load_config

CONF = Path(__file__).resolve().parent.parent / "conf"


def documented_keys(path: Path) -> dict[str, set[str]]:
    """Keys set or shown commented-out (``# key = value``) in each section of a TOML file."""
    sections: dict[str, set[str]] = {}
    current: set[str] = set()
    for line in path.read_text().splitlines():
        if section := re.fullmatch(r"\[(\w+)\]", line.strip()):
            current = sections.setdefault(section[1], set())
        elif key := re.match(r"#? ?(\w+) = ", line):
            current.add(key[1])
    return sections


def test_default_toml_documents_every_key_with_its_default():
    default = Config()
    documented = documented_keys(CONF / "default.toml")
    struct_sections = {f: getattr(default, f) for f in Config.__struct_fields__}
    assert set(documented) == set(struct_sections)
    for name, section in struct_sections.items():
        assert documented[name] == set(type(section).__struct_fields__), name
    # the values that are set are the Structs' defaults
    assert load_config(CONF / "default.toml") == default


def test_test_toml_loads():
    cfg = load_config(CONF / "test.toml")
    assert cfg.engine.block_size == 8 and cfg.model.device == "cpu"


@pytest.mark.parametrize("text, key, reason", [
    ("[engine]\nmax_bach = 3\n", "max_bach", "unknown field"),
    ("[engine]\nblock_size = \"big\"\n", "block_size", "Expected `int`"),
    ("[engine]\nblock_size = 0\n", "block_size", "must be in 1..1024"),
    ("[model]\ndtype = \"int4\"\n", "dtype", "Invalid enum value"),
    ("[speculative]\ndraft_dtype = \"int8\"\n", "draft_dtype", "Invalid enum value"),
    ("[nope]\nx = 1\n", "nope", "unknown field"),
    ("[model]\ntgt_lang = \"fr\"\n", "tgt_lang", "must be an NLLB language code"),
    ("[speculative]\nconfidence_threshold = 1.0\n", "confidence_threshold", "must be in [0, 1)"),
    ("[speculative]\ndisable_by_batch_size = -1\n", "disable_by_batch_size", "must be >= 0"),
    ("[engine]\nkv_cache_memory_gb = inf\n", "kv_cache_memory_gb", "must be a finite number"),
    ("[server]\ndrain_timeout_s = inf\n", "drain_timeout_s", "must be a finite number"),
    ("[prefix_cache]\nsnapshot_memory_gb = nan\n", "snapshot_memory_gb",
     "must be a finite number"),
    ("[model]\nkeep_quantized = \"int4\"\n", "keep_quantized", "Invalid enum value 'int4'"),
    ("[model]\nclassifier_from_tokens = []\n", "classifier_from_tokens",
     "must name at least one token"),
    ("[model]\nchat_template = \"\"\n", "chat_template",
     "must name a template file or hold a template"),
    ("[server]\ntool_call_parser = \"granite\"\n", "tool_call_parser",
     "'hermes', 'llama3_json', 'pythonic', 'mistral'"),
])
def test_rejections_name_file_and_key(tmp_path, text, key, reason):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and key in str(e.value) and reason in str(e.value)


def test_overrides_are_toml_literals_or_bare_strings():
    cfg = load_config(None, ["engine.num_kv_blocks=64", "model.path=/tmp/m", "model.dtype=\"float16\""])
    assert cfg.engine.num_kv_blocks == 64 and cfg.model.path == "/tmp/m"
    assert cfg.model.dtype == "float16"
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["engine.block_size"])
    with pytest.raises(ConfigError) as e:  # the message names where a bad value may be
        load_config(None, ["speculative.num_speculative_tokens=0", "engine.block_size=8"])
    assert "with the overrides speculative.num_speculative_tokens, engine.block_size" in str(e.value)

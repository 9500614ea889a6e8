"""The ``heron`` command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from heron.core.chat_template import ChatTemplateError, read_chat_template
from heron.core.config import ConfigError, dump_config, load_config, parse_override


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="HF model directory or .gguf file "
                   "(default: [model] path from the config, else SmolLM2-135M-Instruct)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a config key (TOML literal)")
    p.add_argument("--chat-template", metavar="FILE", help="the chat template in place of "
                   "the tokenizer's, a file or the template itself (model.chat_template)")


def _config(args):
    overrides = dict(parse_override(item) for item in args.overrides)
    if getattr(args, "model", None):
        overrides["model.path"] = args.model
    if getattr(args, "chat_template", None):
        overrides["model.chat_template"] = args.chat_template
    for key in ("host", "port"):
        if getattr(args, key, None) is not None:
            overrides[f"server.{key}"] = getattr(args, key)
    config = load_config(args.config, overrides)
    # keys from the environment stay out of `ps` output and shell history
    env_keys = [k.strip() for k in os.environ.get("HERON_API_KEYS", "").split(",") if k.strip()]
    if env_keys:
        overrides["server.api_keys"] = config.server.api_keys + env_keys
        config = load_config(args.config, overrides)
    _check_plugin_names(config)
    if config.model.chat_template:  # a missing file fails here, before a model loads
        try:
            read_chat_template(config.model.chat_template)
        except ChatTemplateError as e:
            raise ConfigError(str(e)) from None
    return config


def _check_plugin_names(config) -> None:
    """Names only plugins define (a speculative method) fail here, before a model loads."""
    method = config.speculative.method
    if method:
        from heron.core.plugins import PluginManager
        registered = PluginManager().proposers
        if method not in registered:
            raise ConfigError(f"[speculative] method {method!r} is not registered; "
                              f"registered: {sorted(registered)}")


def cmd_serve(args) -> int:
    config = _config(args)
    if config.model.path is not None and not Path(config.model.path).expanduser().exists():
        raise ConfigError(f"model path {config.model.path!r} does not exist")
    from heron.server.lifecycle import serve
    from heron.server.logs import configure_logging
    configure_logging(config.logging)
    import structlog
    log = structlog.get_logger("heron.server")
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:  # before the server listened (while loading): nothing to drain
        return 130
    except (OSError, ValueError, RuntimeError) as e:  # model load or bind failures
        log.error("could not serve", error=f"{type(e).__name__}: {e}")
        print(f"heron: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_config(args) -> int:
    sys.stdout.write(dump_config(_config(args)))
    return 0


class UsageError(Exception):
    """A bad argument: reported in one line, exit status 2 (as argparse's own)."""


def cmd_generate(args) -> int:
    from heron.core.engine import Engine
    from heron.core.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    try:
        params.validate()
    except ValueError as e:  # "<field> is out of range: ...": name the flag instead
        field, rest = str(e).split(" ", 1)
        raise UsageError(f"--{field.replace('_', '-')} {rest}") from None
    if not args.prompt:
        raise UsageError("--prompt must not be empty")
    engine = Engine(_config(args))
    if engine.pooler is not None:
        task, route = (("classify", "/classify") if engine.pooler.pooling.classifies
                       else ("embed", "/v1/embeddings"))
        raise UsageError(f"the model serves model.task = \"{task}\"; it generates nothing: "
                         f"serve it and call {route}")
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_plugins(args) -> int:
    from heron.core.plugins import PluginManager
    pm = PluginManager()
    for info in pm.plugins.values():
        families = ", ".join(info.families) or "-"
        kernels = f" kernels: {len(info.kernel_files)} file(s)" if info.kernel_files else ""
        print(f"{info.name} {info.version or '?'} ({info.module}) families: {families}{kernels}")
    return 0


def cmd_kernels(args) -> int:
    from heron.core.kernel_check import run_check
    return run_check(tuple(args.arch))


def cmd_fetch_model(args) -> int:
    from heron.core.default_model import ensure_default_model
    print(ensure_default_model())
    return 0


def cmd_train_mtp(args) -> int:
    import json
    import logging

    from heron.core.default_model import ensure_default_model
    from heron.plugins.mtp.train import train_mtp
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = Path(args.model).expanduser() if args.model else ensure_default_model()
    if not model.exists():
        raise ConfigError(f"model path {str(model)!r} does not exist")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    result = train_mtp(model, Path(args.out), **train_mtp_settings(args))
    print(json.dumps({"out": args.out, **result}, indent=2))
    return 0


_TRAIN_MTP_FLAGS = (  # flag, train_mtp's keyword, type, help
    ("--prompts", "num_prompts", int, "generated samples"),
    ("--max-tokens", "max_tokens", int, "tokens per sample"),
    ("--draft-vocab", "draft_vocab", int,
     "most frequent tokens the head drafts (0: the whole vocabulary)"),
    ("--epochs", "epochs", int, "epochs of the first stage"),
    ("--lr", "lr", float, "learning rate of the first stage"),
    ("--depth", "depth", int, "chained drafts trained for"),
    ("--copy-prompts", "num_copy_prompts", int, "samples of the copying stage (0: none)"),
    ("--copy-epochs", "copy_epochs", int, "epochs of the copying stage"),
    ("--hidden-layer", "hidden_layer", str, "the model's layer whose output the head reads: "
                                            "a number from 1, auto or final"),
    ("--init", "init", Path, "a head written before: only the copying stage runs, on it"),
    ("--samples", "samples_file", Path, "a file keeping the generated samples, reused when "
                                        "it holds those of the same model and settings"),
    ("--seed", "seed", int, None),
)
_TRAIN_MTP_OPTIONS = {dest for _, dest, _, _ in _TRAIN_MTP_FLAGS}


def train_mtp_settings(args: argparse.Namespace) -> dict:
    """``train_mtp``'s keywords from the options given; those left out keep its defaults."""
    return {k: v for k, v in vars(args).items() if k in _TRAIN_MTP_OPTIONS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="heron", description="heron LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text offline for one prompt")
    _add_config_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve MODEL over an OpenAI-compatible HTTP API "
                       "(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
                       "/v1/translations for translation models, /tokenize, "
                       "/detokenize, /health, /metrics, /openapi.json).")
    _add_config_args(p)
    p.add_argument("--host", help="address to listen on (server.host; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (server.port; default 8000)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("config", help="print the effective configuration as TOML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("plugins", help="list loaded plugins and what they register")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("kernels", help="CUDA kernel tools")
    p.add_argument("--check", action="store_true", required=True,
                   help="compile every registered kernel without a GPU")
    p.add_argument("--arch", action="append", default=None, help="e.g. sm_90 (repeatable)")
    p.set_defaults(func=cmd_kernels)

    p = sub.add_parser("train-mtp", help="train an MTP drafting head by self-distillation",
                       description="Train a multi-token-prediction head for a transformer "
                       "MODEL on text the model generates itself, and write it (DeepSeek-V3 "
                       "layout) to OUT, for [speculative] method = \"mtp\", model = OUT. "
                       "Options left out keep the recipe's defaults "
                       "(heron.plugins.mtp.train.train_mtp).")
    p.add_argument("model", nargs="?", help="HF model directory or .gguf file "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    # left out, these keep train_mtp's defaults (heron.plugins.mtp.train)
    for flag, dest, kind, text in _TRAIN_MTP_FLAGS:
        p.add_argument(flag, dest=dest, type=kind, help=text, default=argparse.SUPPRESS,
                       metavar="FILE" if kind is Path else "N")
    p.set_defaults(func=cmd_train_mtp)

    p = sub.add_parser("fetch-model", help="fetch the default model into the cache")
    p.set_defaults(func=cmd_fetch_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "kernels" and args.arch is None:
        args.arch = ["sm_80", "sm_90"]
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"heron: config error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"heron {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a model that cannot be read, a bad training setting
        print(f"heron: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Logging: structlog for everything, stdlib loggers routed through the same renderer.

JSON lines when stderr is not a terminal (or ``logging.format = "json"``), a readable
console format on one. Each finished request writes one line (see `generation`).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from heron.core.config import LoggingConfig


def configure_logging(cfg: LoggingConfig, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    as_json = cfg.format == "json" or (cfg.format == "auto" and not stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if as_json
                else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
        foreign_pre_chain=shared)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(cfg.level.upper())
    # aiohttp's access log would be a second line per request; ours says more
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

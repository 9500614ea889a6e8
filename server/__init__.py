"""heron's OpenAI-compatible HTTP server (aiohttp) and the ``heron`` command line.

`create_app(config)` builds the application; `heron serve` runs it. The import is lazy so
that ``heron --help`` does not load aiohttp, torch or the engine.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from heron.server.app import create_app
        return create_app
    raise AttributeError(name)

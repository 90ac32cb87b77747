"""uvicorn's HTTP parser and event loop for ``trtllm-glm serve``: the names a deployment may ask for and the pair a
server runs (`choose_http_loop`).

A module of its own, without uvicorn, so that the options file (`serve.config`) and the command line check a name
before anything starts; `serve.server` runs the pair chosen and logs it.
"""

from __future__ import annotations

__all__ = ["HTTP_CHOICES", "LOOP_CHOICES", "choose_http_loop"]

# "auto" prefers the C one (httptools, uvloop) and falls back to the pure-Python one (h11, asyncio) when it does not
# import; a named one is used as named (an error when it does not import).
HTTP_CHOICES = ("auto", "httptools", "h11")
LOOP_CHOICES = ("auto", "uvloop", "asyncio")


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def choose_http_loop(http: str = "auto", loop: str = "auto") -> tuple[str, str]:
    """The ``(http, loop)`` pair a server runs: ``"auto"`` is ``httptools`` / ``uvloop`` when the package imports, else
    ``h11`` / ``asyncio``; a named one is kept.

    Raises:
        ValueError: a name outside `HTTP_CHOICES` / `LOOP_CHOICES`, or a C one named that does not import (never a
            silent fall-back: whoever named it measured or relies on it).
    """
    if http not in HTTP_CHOICES:
        raise ValueError(f"http must be one of {', '.join(HTTP_CHOICES)}, got {http!r}")
    if loop not in LOOP_CHOICES:
        raise ValueError(f"loop must be one of {', '.join(LOOP_CHOICES)}, got {loop!r}")
    out = []
    for asked, fast, pure in ((http, "httptools", "h11"), (loop, "uvloop", "asyncio")):
        if asked == "auto":
            out.append(fast if _importable(fast) else pure)
        elif asked == fast and not _importable(fast):
            raise ValueError(f"{fast} is not installed (pip install 'trtllm_glm[serve]'), or choose {pure}")
        else:
            out.append(asked)
    return out[0], out[1]

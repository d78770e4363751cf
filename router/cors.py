"""CORS for the public API (`--allowed-origins` & co., named as vllm serve's): which browser origins may call
/v1/*. Off unless origins are given: vllm allows every origin by default, pdserve none, so a router reachable
from a browser does not answer other sites' scripts by accident.

Installed outermost (after create_app), so a preflight OPTIONS, which carries no API key, is answered here
before the front door (router/front_door.py) would refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fastapi is imported where the middleware is installed: every `pdserve` command's parser
    from fastapi import FastAPI  # reads CorsSettings, and importing fastapi took ~0.3 s of each one's start


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"an allowed origin is '*' or scheme://host[:port], got {origin!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)


def install_cors(app: FastAPI, settings: CorsSettings) -> None:
    """Call before the app starts (Starlette builds its middleware stack on the first request)."""
    if not settings.enabled:
        return
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)

"""The MCP suite shares the SDK suite's live ``aviary serve`` fixture (and
uses the SDK to check effects from outside the MCP session)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "sdk" / "python"))

from tests.conftest import LiveServer, server  # noqa: E402,F401

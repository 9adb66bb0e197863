"""The parts of the SDK that need no server: what a sandbox's listing may
make the SDK write locally, the SSE framing, the exec event fold, errors."""

from __future__ import annotations

import base64
import json
import os
from typing import List, Optional

import pytest

import aviary
from aviary._wire import ExecCollector, SseDecoder, label_filter, safe_relative
from aviary.models import FileInfo


def entry(path: str, kind: str = "file") -> FileInfo:
    return FileInfo(name=path.rsplit("/", 1)[-1], path=path, kind=kind, size=1, mode=0o644, modified_unix=0)


@pytest.mark.parametrize(
    "path",
    [
        "/workspace/proj/../../etc/passwd",
        "/workspace/projX/file",
        "/etc/passwd",
        "/workspace/proj",
        "/workspace/proj/",
        "/workspace/proj//x",
        "/workspace/proj/./x",
        "/workspace/proj/a\\..\\b",
        "relative/x",
    ],
)
def test_a_hostile_listing_never_names_a_path_outside_the_target(path: str) -> None:
    assert safe_relative("/workspace/proj", entry(path)) is None


def test_plain_descendants_map_below_the_target() -> None:
    assert safe_relative("/workspace/proj", entry("/workspace/proj/a/b.txt")) == os.path.join("a", "b.txt")
    assert safe_relative("/workspace/proj/", entry("/workspace/proj/x")) == "x"


def test_sse_frames_and_keepalives() -> None:
    d = SseDecoder()
    frames = [d.feed(line) for line in [":keep-alive", "", "event: stdout", 'data: {"a":', "data: 1}", ""]]
    assert [f for f in frames if f] == [("stdout", '{"a":\n1}')]


def test_exec_events_fold_into_the_result_and_split_utf8_is_kept() -> None:
    seen: List[str] = []
    c = ExecCollector(seen.append, None)
    snow = "☃".encode()
    for chunk in (snow[:1], snow[1:] + b"\n"):
        assert not c.event("stdout", json.dumps({"type": "stdout", "data": base64.b64encode(chunk).decode()}))
    result = {"exit_code": 0, "stdout": "", "stderr": "", "duration_ms": 1.0, "timed_out": False, "oom_killed": False}
    assert c.event("exit", json.dumps({"type": "exit", "result": result}))
    assert c.finish().stdout == "☃\n" and "".join(seen) == "☃\n"
    with pytest.raises(aviary.LeaseRequired):
        ExecCollector(None, None).event("error", json.dumps({"type": "error", "code": "lease_required", "message": "m"}))
    with pytest.raises(aviary.ProtocolError):
        ExecCollector(None, None).finish()


def test_unknown_codes_still_reach_the_caller() -> None:
    err: Optional[aviary.ApiError] = aviary.errors.error_for("brand_new_code", "m", status=418)
    assert err is not None and err.code == "brand_new_code" and isinstance(err, aviary.ApiError)
    assert label_filter({"k y": "v&w"}) == "k%20y=v%26w"

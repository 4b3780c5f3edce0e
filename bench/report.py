"""What every benchmark writes besides its numbers: when and how it ran, and the JSON file itself."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path


def run_info(argv: list[str] | None = None) -> dict:
    """``date`` (UTC) and ``command`` (as typed from the repository root) of this run."""
    args = argv if argv is not None else sys.argv[1:]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *args]),
    }


def write_json(path: str | Path, out: dict, indent: int = 2) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=indent) + "\n")

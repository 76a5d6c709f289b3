"""What every benchmark records next to its figures: machine, commit, command."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from pocketllm import envs


def _command() -> str:
    """How this process was started: the CLI as ``pocketllm ...``, a benchmark script as ``python ...``."""
    started = Path(sys.argv[0])
    if started.name == "pocketllm" or started.parts[-2:] == ("cli", "main.py"):
        return " ".join(["pocketllm"] + sys.argv[1:])
    return " ".join(["python", *sys.argv])


def environment() -> dict:
    import torch

    # A copy of the tree without .git (a remote benchmark machine) names its commit in the environment.
    commit = envs.get("POCKETLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip() or None
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip())
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "dirty": dirty,
        "command": _command(),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "python": platform.python_version(), "torch": torch.__version__},
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "-" if v is None else str(v)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")

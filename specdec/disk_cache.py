"""Measurements kept across runs: small JSON tables in specdec's cache directory
(``$SPECDEC_CACHE``, default ``~/.cache/specdec``), each entry keyed by everything the
measurement depends on (model file, runtime, threads, machine)."""
from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger("specdec")


def directory() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec"))


def machine() -> str:
    """The CPU model and core count (timings and kernel choices depend on them)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.machine()} x{os.cpu_count()}"


def read(path: Path) -> dict:
    """The table at ``path``; empty when it is missing or unreadable."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def store(path: Path, key: str, value) -> None:
    """Set ``table[key] = value`` (read again first, written atomically). A cache that cannot
    be written is a warning: the value only spares the next run measuring it again."""
    table = read(path)
    table[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot write specdec's cache %s (%s); set SPECDEC_CACHE to a writable directory", path, e)

"""Quantities as people read them (torch-free: the loop, `rlcli rm` and the memory plan print them alike)."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"

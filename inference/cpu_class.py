"""The CPU class of this machine: what decides which quantized kernels ONNX Runtime runs.

ONNX Runtime (MLAS) picks its int8 kernels by instruction set: 16-bit pair sums (``vpmaddubsw``)
on AVX2, ``vpdpbusd`` on AVX-VNNI and AVX-512 VNNI, AMX tiles on Sapphire Rapids and later,
NEON dot products on arm64. Those kernels give different numerics for the same graph (on a
plain AVX2 CPU the int8-activation path of ``MatMulNBits`` turned SmolLM2's answers into
gibberish), so a quantized bundle is built for, and keyed by, the class of the CPU that
builds it; fp32 bundles run the same float kernels everywhere and are not keyed.

The class is read once from ``/proc/cpuinfo`` flags (x86-64) or the machine name (arm64);
where neither says anything we know, the class is ``generic``.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Every class, from the plainest to the richest x86 set, then the others.
CPU_CLASSES: tuple[str, ...] = (
    "generic", "avx2", "avx2-vnni", "avx512", "avx512-vnni", "amx", "arm64",
)
_CPUINFO = Path("/proc/cpuinfo")


def classify_flags(flags: Iterable[str], machine: str = "x86_64") -> str:
    """The class of an x86-64 CPU with these ``/proc/cpuinfo`` flags (or of ``machine``)."""
    if machine.lower() in ("aarch64", "arm64"):
        return "arm64"
    have = set(flags)
    if "amx_int8" in have and "avx512_vnni" in have:
        return "amx"
    if {"avx512f", "avx512bw"} <= have:
        return "avx512-vnni" if "avx512_vnni" in have else "avx512"
    if "avx2" in have and "fma" in have:
        return "avx2-vnni" if "avx_vnni" in have else "avx2"
    return "generic"


def _cpuinfo_flags(text: str) -> list[str]:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.split()
    return []


@functools.cache
def cpu_class() -> str:
    """This machine's CPU class (one of :data:`CPU_CLASSES`), read once per process."""
    machine = platform.machine()
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:  # not Linux: only the machine name is known
        text = ""
    return classify_flags(_cpuinfo_flags(text), machine)


def cpu_class_mismatch(engine_meta: Mapping[str, Any]) -> str | None:
    """Why a bundle (its ``engine.json``) must not run on this CPU, or None.

    A quantized CPU bundle records under ``kernels.cpu_class`` the class its int8 kernels were
    chosen and gated for; another class runs other kernels whose answers were never checked.
    """
    kernels = engine_meta.get("kernels")
    built_for = kernels.get("cpu_class") if isinstance(kernels, Mapping) else None
    if built_for is None or built_for == cpu_class():
        return None
    return (f"built for CPU class {built_for} but this CPU is {cpu_class()}: its quantized kernels "
            "were chosen and checked for that class; rebuild it on this machine")

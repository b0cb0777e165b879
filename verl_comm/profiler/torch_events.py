"""Communication and device events read back from torch.profiler's Chrome trace.

:func:`torch_events` moves the trace's events into the ``time.perf_counter`` timebase of
:class:`~verl_comm.profiler.VerlProfiler` through the :data:`ANCHOR` range it records when
torch.profiler starts, and keeps gloo work events, c10d calls and device kernels (NCCL
kernels marked as communication, with the bytes their args give).
"""

from __future__ import annotations

import math

ANCHOR = "verl_profiler::anchor"
"""Name of the ``record_function`` range whose start is also taken with ``perf_counter``."""

# Element sizes of the dtype names torch's profiler writes in NCCL kernel args.
_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Char": 1, "Byte": 1,
    "Int": 4, "Long": 8, "Short": 2, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}  # fmt: skip
# ... and the C++ type names of its "Input type" (``record_shapes``) on gloo work events.
_CTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "signed char": 1,
    "unsigned char": 1, "int": 4, "long int": 8, "short int": 2, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}  # fmt: skip


def gloo_input_bytes(args: dict) -> dict:
    """``in_bytes`` of a gloo work event (first input's shape times its element size)
    from ``Input Dims`` / ``Input type``, present when torch.profiler records shapes."""
    try:
        dims, ctype = args["Input Dims"][0], args["Input type"][0]
        size = _CTYPE_BYTES[str(ctype)]
        return {"in_bytes": int(math.prod(int(d) for d in dims)) * size}
    except (KeyError, IndexError, TypeError, ValueError):
        return {}


def collective_args(args: dict) -> dict:
    """``collective``, ``group_size`` and ``in_bytes`` (input message bytes) of an NCCL
    kernel event from the args torch's profiler attaches (``Collective name``, ``In msg
    nelems``, ``dtype``, ``Group size``); keys whose source is absent are left out."""
    out: dict = {}
    if "Collective name" in args:
        out["collective"] = str(args["Collective name"])
    if "Group size" in args:
        try:
            out["group_size"] = int(args["Group size"])
        except (TypeError, ValueError):
            pass
    size = _DTYPE_BYTES.get(str(args.get("dtype", "")))
    try:
        nelems = int(args["In msg nelems"])
    except (KeyError, TypeError, ValueError):
        nelems = None
    if size is not None and nelems is not None:
        out["in_bytes"] = nelems * size
    return out


def torch_events(trace: dict, anchor_t: float) -> tuple[float, list[dict], list[dict]] | None:
    """``(offset_s, comm, kernels)`` of a Chrome trace, or None without the anchor range.

    Args:
        trace: the Chrome trace JSON (``traceEvents`` of complete events, ``ts``/``dur`` in
            microseconds).
        anchor_t: ``time.perf_counter()`` taken when the :data:`ANCHOR` range was entered.

    Returns:
        offset_s: add to a trace time in seconds to get ``perf_counter`` time.
        comm: gloo work (``source`` "gloo", with ``in_bytes`` when shapes were recorded),
            c10d calls ("c10d") and NCCL kernels ("kernel", with :func:`collective_args`).
        kernels: every device kernel, memcpy and memset (``comm`` True for NCCL kernels).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    anchor = next((e for e in events if e.get("name") == ANCHOR), None)
    if anchor is None:
        return None
    off = anchor_t - float(anchor["ts"]) * 1e-6
    comm: list[dict] = []
    kernels: list[dict] = []
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat", "")
        t0 = float(e["ts"]) * 1e-6 + off
        t1 = t0 + float(e["dur"]) * 1e-6
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            is_comm = cat == "kernel" and "nccl" in name.lower()
            rec = {"name": name[:80], "t0": t0, "t1": t1, "comm": is_comm}
            kernels.append(rec)
            if is_comm:
                comm.append({**rec, "source": "kernel", **collective_args(e.get("args") or {})})
        elif name.startswith(("gloo:", "c10d::")):
            src = "gloo" if name.startswith("gloo:") else "c10d"
            rec = {"name": name, "t0": t0, "t1": t1, "source": src}
            if src == "gloo":
                rec.update(gloo_input_bytes(e.get("args") or {}))
            comm.append(rec)
    return off, comm, kernels

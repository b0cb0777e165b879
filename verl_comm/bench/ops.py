"""Benchmark cases: buffers, the collective call, and its closed-form check.

A :class:`Case` is one (collective, method, in-place or not, element count) on one rank.
``run()`` issues the collective once (the timed call); ``fill()`` writes the check
pattern; ``count_wrong()`` compares the result with its closed form.

Check pattern (integers, exact in every dtype we time, bf16 included, for up to 32 ranks):
rank ``r`` holds ``x_r[i] = r + 1 + (i mod 3)`` at global index ``i`` of its input. Sums
over ``W`` ranks are then ``W(W+1)/2 + W (i mod 3)``; gathers and all-to-all move values
that name their source rank and position; broadcast (root 0) gives ``1 + (i mod 3)``.

Methods (all_reduce compares them at equal payload, the user's buffer in ``dtype``):

- ``nccl_fp32``: the collective on the payload itself (fp32 by default; with ``-d`` it is
  the native collective in that dtype). Works on gloo too (the label names the method).
- ``nccl_bf16``: cast the payload to bf16, run the collective in bf16, cast back
  (torch's ``bf16_compress_hook`` path); the two casts are timed.
- ``int8``: our quantized all-reduce (``verl_comm.compression``; see
  :mod:`verl_comm.bench.int8`), all_reduce only, in-place or into a separate output.
- ``bare``: reserved for the bare ``torch.distributed.all_reduce`` loop of
  :func:`verl_comm.bench.timing.time_bare_all_reduce` (all_reduce, in-place only).

torch.distributed has no out-of-place all_reduce: out-of-place ``nccl_fp32`` all_reduce copies
the input into the output and reduces that in place; the copy is timed, as a user would pay
it (compare in-place rows with nccl-tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_comm.bench.int8 import Int8AllReduce

METHODS = ("nccl_fp32", "nccl_bf16", "int8", "bare")

# torch >= 2.13 renames the tensor collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int32": torch.int32,
    "int": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
}

_SHORT = {
    torch.float32: "float",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.float64: "double",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.int8: "int8",
}


class Unsupported(Exception):
    """This (collective, method, placement) combination is not defined; the message says why."""


def parse_dtype(name: str) -> torch.dtype:
    """Map ``-d/--dtype`` text (``float32``, ``bf16``, ``int8``, ...) to a torch dtype.

    Raises:
        ValueError: naming the accepted spellings.
    """
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"-d/--dtype: unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """nccl-tests' short type name (``float``, ``half``, ``bfloat16``, ...)."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def pattern(rank: int, start: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Check pattern of ``rank`` for global indices ``[start, start+count)``: ``rank+1+(i%3)``.

    Returns a 1-D tensor of ``count`` elements of ``dtype`` on ``device``.
    """
    idx = torch.arange(start, start + count, device=device, dtype=torch.int64)
    return (idx.remainder_(3).add_(rank + 1)).to(dtype)


def expected_output(
    collective: str, rank: int, world: int, count: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Closed-form result of ``collective`` on the check pattern, as seen by ``rank``.

    Args:
        count: elements of the collective's ``S`` buffer (see :mod:`verl_comm.bench.sweep`).

    Returns:
        The output buffer ``rank`` must hold: ``count`` elements, except reduce_scatter
        (``count / world``).
    """
    c = count // world
    if collective == "all_reduce":
        idx = torch.arange(count, device=device, dtype=torch.int64)
        return (idx.remainder_(3).mul_(world).add_(world * (world + 1) // 2)).to(dtype)
    if collective == "reduce_scatter":
        idx = torch.arange(rank * c, (rank + 1) * c, device=device, dtype=torch.int64)
        return (idx.remainder_(3).mul_(world).add_(world * (world + 1) // 2)).to(dtype)
    if collective == "all_gather":
        return torch.cat([pattern(s, 0, c, dtype, device) for s in range(world)])
    if collective == "all_to_all":
        return torch.cat([pattern(s, rank * c, c, dtype, device) for s in range(world)])
    if collective == "broadcast":
        return pattern(0, 0, count, dtype, device)
    raise ValueError(f"unknown collective {collective!r}")


def int8_tolerance(world: int) -> float:
    """Absolute error bound of an int8 absmax all-reduce on the check pattern.

    Each rank's block is quantized with step ``absmax/127`` (error <= absmax/254 per
    element), then the owner requantizes the fp32 sum (again <= absmax_sum/254). On the
    pattern, ``sum_r max|x_r| = max|sum| = W(W+1)/2 + 2W``, hence the bound
    ``2 (W(W+1)/2 + 2W) / 254``; 1% slack covers fp32 rounding of the scales.
    """
    m = world * (world + 1) / 2 + 2 * world
    return 2.0 * m / 254.0 * 1.01 + 1e-6


@dataclass
class Case:
    """One collective call on one rank, ready to check and to time.

    Attributes:
        collective, method, inplace: what is timed.
        count: elements of the ``S`` buffer; nbytes: ``count * element size`` (the ``S``
            of the bandwidth formulas).
        run: issues the collective once (blocking call as seen by the host).
        fill: writes the check pattern into the input.
        count_wrong: number of output elements off their closed form (beyond ``tol``).
        output: the payload tensor that ``count_wrong`` checks.
        reset: None, or a call made outside the timed window before each iteration
            (restores inputs for methods whose speed could depend on the values).
    """

    collective: str
    method: str
    inplace: bool
    count: int
    nbytes: int
    dtype: torch.dtype
    run: Callable[[], None]
    fill: Callable[[], None]
    count_wrong: Callable[[], int]
    output: torch.Tensor
    reset: Callable[[], None] | None = None


def _check_method(
    collective: str, method: str, dtype: torch.dtype, int8: Int8AllReduce | None
) -> None:
    """Raise :class:`Unsupported` (or ValueError for an unknown method) for a method that
    cannot run this collective and dtype."""
    if method == "bare":
        raise Unsupported("'bare' is timed by time_bare_all_reduce, not through a Case")
    if method == "int8":
        if collective != "all_reduce":
            raise Unsupported("int8 is an all_reduce method")
        if not dtype.is_floating_point:
            raise Unsupported("int8 quantizes floating-point payloads; use -d float32")
        if int8 is None or not int8.available:
            reason = int8.reason if int8 is not None else "no int8 implementation given"
            raise Unsupported(f"int8 all-reduce unavailable: {reason}")
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")


def _payload_buffers(
    collective: str,
    inplace: bool,
    count: int,
    lo: int,
    c: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inp, out)``: the payload buffers (the user's view) in ``dtype``; ``count``
    elements in all, this rank's chunk ``[lo, lo + c)``."""
    if collective == "all_reduce":
        out = torch.empty(count, dtype=dtype, device=device)
        return (out if inplace else torch.empty(count, dtype=dtype, device=device)), out
    if collective in ("reduce_scatter", "all_gather"):
        # the full buffer and this rank's chunk (in place: the chunk is a view of it)
        full = torch.empty(count, dtype=dtype, device=device)
        part = full[lo : lo + c] if inplace else torch.empty(c, dtype=dtype, device=device)
        return (full, part) if collective == "reduce_scatter" else (part, full)
    if collective == "all_to_all":
        if inplace:
            raise Unsupported("all_to_all_single needs distinct input and output buffers")
        return (
            torch.empty(count, dtype=dtype, device=device),
            torch.empty(count, dtype=dtype, device=device),
        )
    if collective == "broadcast":
        if not inplace:
            raise Unsupported("torch.distributed.broadcast is in-place only")
        out = torch.empty(count, dtype=dtype, device=device)
        return out, out
    raise ValueError(f"--op: unknown collective {collective!r}")


def _wire_buffers(
    collective: str,
    inplace: bool,
    count: int,
    lo: int,
    c: int,
    inp: torch.Tensor,
    out: torch.Tensor,
    wire: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_in, w_out)``: the buffers the collective runs on: the payload itself, or
    copies in the ``wire`` dtype (bf16 for nccl_bf16)."""
    if wire == inp.dtype:
        return inp, out
    device = out.device
    w_out = torch.empty(out.numel(), dtype=wire, device=device)
    if collective == "all_reduce":
        return w_out, w_out  # the cast into the wire buffer is the out-of-place copy
    if not inplace:
        return torch.empty(inp.numel(), dtype=wire, device=device), w_out
    if collective == "reduce_scatter":
        w_in = torch.empty(count, dtype=wire, device=device)
        return w_in, w_in[lo : lo + c]
    if collective == "all_gather":
        return w_out[lo : lo + c], w_out
    return w_out, w_out


def build_case(
    collective: str,
    method: str,
    inplace: bool,
    count: int,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    int8: Int8AllReduce | None = None,
) -> Case:
    """Allocate the buffers of one case and return it.

    Raises:
        Unsupported: when the combination does not exist (e.g. out-of-place broadcast,
            int8 on another collective, int8 implementation unavailable).
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    esize = torch.empty((), dtype=dtype).element_size()
    c = count // world
    _check_method(collective, method, dtype, int8)

    wire = torch.bfloat16 if method == "nccl_bf16" else dtype
    tol = int8_tolerance(world) if method == "int8" else 0.0
    src = dist.get_global_rank(group, 0) if group is not None else 0

    inp, out = _payload_buffers(collective, inplace, count, rank * c, c, dtype, device)
    w_in, w_out = _wire_buffers(collective, inplace, count, rank * c, c, inp, out, wire)

    def collective_call() -> None:
        if collective == "all_reduce":
            if w_in is not w_out:
                w_out.copy_(w_in)
            dist.all_reduce(w_out, group=group)
        elif collective == "reduce_scatter":
            _reduce_scatter(w_out, w_in, group=group)
        elif collective == "all_gather":
            _all_gather(w_out, w_in, group=group)
        elif collective == "all_to_all":
            dist.all_to_all_single(w_out, w_in, group=group)
        else:
            dist.broadcast(w_out, src=src, group=group)

    if method == "int8":
        assert int8 is not None
        run = int8.make(inp, out, group)

    elif wire == dtype:
        run = collective_call
    else:

        def run() -> None:
            w_in.copy_(inp)  # cast to the wire dtype
            collective_call()
            out.copy_(w_out)

    def fill() -> None:
        inp.copy_(pattern(rank, 0, inp.numel(), dtype, device))

    def count_wrong() -> int:
        exp = expected_output(collective, rank, world, count, dtype, device)
        diff = (out.to(torch.float64) - exp.to(torch.float64)).abs_()
        return int((~(diff <= tol)).sum().item())

    reset = None
    if method == "int8" and inplace:
        # In-place sums grow by W each iteration; quantization scales must stay finite.
        pristine = pattern(rank, 0, count, dtype, device)

        def reset() -> None:
            out.copy_(pristine)

    return Case(
        collective, method, inplace, count, count * esize, dtype, run, fill, count_wrong, out, reset
    )

"""Delta weight-sync codec: send only the rollout-dtype elements that changed.

At RL learning rates most bf16 casts of the fp32 master weights do not move in one
optimizer step (about 1-3% change; verl's delta weight sync relies on the same fact), so
a weight sync can send positions and new values instead of whole tensors. Per bucket the
encoder compares the new rollout-dtype weights with the copy it sent last, **bit for
bit** (the elements are compared as integers, so ``-0.0`` vs ``0.0`` and NaN payloads count
as changes and the receiver ends bit-identical), and picks the smallest of three
encodings:

- ``INDEX``: ``k`` int32 positions, then ``k`` values: ``k * (4 + itemsize)`` bytes;
- ``BITMASK``: ``ceil(n / 8)`` bytes of a little-endian bitmask, then ``k`` values;
- ``FULL``: the ``n`` values: ``n * itemsize`` bytes.

Ties go to the earlier one in that order; ``k == 0`` gives an empty ``INDEX`` payload.
Decoding writes into the receiver's copy in place. The codec is lossless: after decoding,
the receiver's bytes equal the sender's (tests/verl_ppo/test_reshard_delta.py checks it
over 20 random updates).

:func:`checksum` proves that after a sync: two int64 sums over the 16-bit words of the
tensor, ``s1 = sum(w_i)`` and ``s2 = sum((i + 1) * w_i)`` mod 2^64 (Fletcher's position
weighting, so swapped or shifted elements change ``s2``). Integer addition mod 2^64 is
associative and commutative, so the result does not depend on the reduction order and
is the same on CPU and CUDA; it runs where the tensor lives and moves 16 bytes to the
host (a CRC over the bytes, e.g. ``zlib.crc32``, would first copy the whole shard to the
host). It is a consistency check against transport or bookkeeping bugs, not a
cryptographic hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL, INDEX, BITMASK = 0, 1, 2
ENCODINGS = {FULL: "full", INDEX: "index", BITMASK: "bitmask"}
_CHUNK = 1 << 22  # elements per checksum chunk: bounds the int64 temporaries to 32 MiB
_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class EncodedBucket:
    """One bucket's update on the wire.

    Attributes:
        kind: :data:`FULL`, :data:`INDEX` or :data:`BITMASK`.
        numel: elements in the bucket.
        changed: elements that differ from the reference (bitwise).
        payload: 1-D uint8 tensor of :func:`encoded_nbytes` bytes, on the input's device.
    """

    kind: int
    numel: int
    changed: int
    payload: torch.Tensor


def _int_view(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass tensor.contiguous()")
    if t.element_size() != 2 or not t.is_floating_point():
        raise ValueError(f"{name} must be a 16-bit float tensor (bf16/fp16), got {t.dtype}")
    return t.view(torch.int16)


def encoded_nbytes(kind: int, numel: int, changed: int, itemsize: int = 2) -> int:
    """Payload bytes of an encoding of a bucket of ``numel`` elements, ``changed`` of them
    new, ``itemsize`` bytes each.

    Raises:
        ValueError: unknown kind.
    """
    if kind == FULL:
        return numel * itemsize
    if kind == INDEX:
        return changed * (4 + itemsize)
    if kind == BITMASK:
        return -(-numel // 8) + changed * itemsize
    raise ValueError(f"unknown encoding {kind}; expected one of {sorted(ENCODINGS)}")


def choose_encoding(numel: int, changed: int, itemsize: int = 2) -> int:
    """The smallest encoding for ``changed`` of ``numel`` elements (ties: INDEX, BITMASK,
    FULL in that order)."""
    return min((INDEX, BITMASK, FULL), key=lambda k: encoded_nbytes(k, numel, changed, itemsize))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.view(dtype)``, copying first when ``t`` starts at a misaligned byte offset."""
    size = torch.empty((), dtype=dtype).element_size()
    return (t if t.storage_offset() % size == 0 else t.clone()).view(dtype)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor(_BITS, dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    weights = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) & weights) != 0).view(-1)[:n]


def encode(reference: torch.Tensor, new: torch.Tensor) -> EncodedBucket:
    """Encode ``new`` against ``reference`` (what the receiver holds), smallest per bucket.

    Args:
        reference: 1-D contiguous bf16/fp16 tensor, the values the receiver holds now.
        new: same shape, dtype and device: the values it must hold after decoding.

    Returns:
        an :class:`EncodedBucket` (the payload never aliases the inputs).

    Raises:
        ValueError: shapes, dtypes or devices differ, a tensor is not 1-D, contiguous and
            16-bit floating point.
    """
    if reference.shape != new.shape or reference.dtype != new.dtype:
        raise ValueError(
            f"reference {tuple(reference.shape)} {reference.dtype} and new "
            f"{tuple(new.shape)} {new.dtype} differ"
        )
    if reference.device != new.device:
        raise ValueError(f"reference on {reference.device}, new on {new.device}")
    old_w, new_w = _int_view(reference, "reference"), _int_view(new, "new")
    n = new.numel()
    mask = old_w != new_w
    changed = int(mask.sum())
    kind = choose_encoding(n, changed, new.element_size())
    if kind == FULL:
        payload = new_w.clone().view(torch.uint8)
    else:
        values = new_w[mask].view(torch.uint8)
        if kind == INDEX:
            pos = mask.nonzero().view(-1).to(torch.int32).view(torch.uint8)
            payload = torch.cat([pos, values])
        else:
            payload = torch.cat([_pack_bits(mask), values])
    assert payload.numel() == encoded_nbytes(kind, n, changed, new.element_size())
    return EncodedBucket(kind, n, changed, payload)


def decode_(target: torch.Tensor, kind: int, changed: int, payload: torch.Tensor) -> None:
    """Apply an encoded update to ``target`` in place (the receiver's copy).

    Args:
        target: 1-D contiguous bf16/fp16 tensor holding the reference the update was
            encoded against.
        kind, changed: from the sender's :class:`EncodedBucket`.
        payload: 1-D uint8 tensor of ``encoded_nbytes(kind, target.numel(), changed)`` bytes.

    Raises:
        ValueError: a payload of the wrong size or dtype, or a bad target.
    """
    w = _int_view(target, "target")
    n, isz = target.numel(), target.element_size()
    want = encoded_nbytes(kind, n, changed, isz)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != want:
        raise ValueError(
            f"{ENCODINGS.get(kind, kind)} payload for {n} elements ({changed} changed) must be "
            f"{want} uint8 bytes, got {payload.numel()} {payload.dtype}"
        )
    if kind == FULL:
        w.copy_(_as(payload, torch.int16))
    elif kind == INDEX:
        pos = _as(payload[: 4 * changed], torch.int32).long()
        w[pos] = _as(payload[4 * changed :], torch.int16)
    else:
        nb = -(-n // 8)
        mask = _unpack_bits(payload[:nb], n)
        w[mask] = _as(payload[nb:], torch.int16)


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """``(s1, s2)`` over the 16-bit words of ``t`` (see the module docstring).

    Args:
        t: contiguous tensor of a 16-bit dtype (or a 32-bit one, read as twice as many
            16-bit words), any shape and device.

    Returns:
        two Python ints in ``[-2^63, 2^63)`` (int64 sums, wrapping).

    Raises:
        ValueError: not contiguous, or neither 16- nor 32-bit.
    """
    if not t.is_contiguous() or t.element_size() not in (2, 4):
        raise ValueError(f"checksum needs a contiguous 16- or 32-bit tensor, got {t.dtype}")
    w = t.reshape(-1).view(torch.int16)
    s1 = torch.zeros((), dtype=torch.int64, device=t.device)
    s2 = torch.zeros((), dtype=torch.int64, device=t.device)
    for a in range(0, w.numel(), _CHUNK):
        x = w[a : a + _CHUNK].to(torch.int64) & 0xFFFF
        idx = torch.arange(a + 1, a + 1 + x.numel(), dtype=torch.int64, device=t.device)
        s1 += x.sum()
        s2 += (x * idx).sum()
    return int(s1), int(s2)

"""Delta weight-sync codec: lossless (bit for bit), sizes as chosen, odd shapes, bad input.

Bit equality is the property under test (the receiver must hold the sender's exact bf16
bytes), so tensors are compared with ``torch.equal`` on their int16 views.
"""

import numpy as np
import pytest
import torch

from verl_ppo.reshard.delta import (
    BITMASK,
    FULL,
    INDEX,
    _changed_host,
    _changed_torch,
    _pack_bits,
    _unpack_bits,
    changed_positions,
    checksum,
    choose_encoding,
    combine_checksums,
    decode_,
    encode,
    encoded_nbytes,
    word_aligned,
)


def _bits(t):
    return t.view(torch.int16)


def _updates(n, steps=20, seed=0):
    """fp32 master weights moved by AdamW-sized steps of varying size, cast to bf16; step 5
    changes nothing, step 9 flips the lowest bit of every element (everything changes)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    for step in range(steps):
        if step == 5:
            yield master.to(torch.bfloat16), "none"
            continue
        if step == 9:
            flipped = master.to(torch.bfloat16).view(torch.int16) ^ 1
            master = flipped.view(torch.bfloat16).float()
            yield master.to(torch.bfloat16), "all"
            continue
        lr = [1e-6, 1e-5, 1e-4, 1e-3][step % 4]
        master = master - lr * torch.randn(n, generator=g).sign()
        yield master.to(torch.bfloat16), "step"


@pytest.mark.parametrize("n", [1, 7, 4096, 1823 * 7])
def test_delta_bit_exact_over_20_updates(n):
    sender_ref = torch.zeros(n, dtype=torch.bfloat16)
    receiver = torch.zeros(n, dtype=torch.bfloat16)
    kinds = set()
    for new, what in _updates(n):
        enc = encode(sender_ref, new)
        changed = int((_bits(sender_ref) != _bits(new)).sum())
        assert enc.changed == changed
        assert enc.payload.numel() == encoded_nbytes(enc.kind, n, changed)
        assert enc.kind == choose_encoding(n, changed)
        if what == "none":
            assert changed == 0 and enc.kind == INDEX and enc.payload.numel() == 0
        if what == "all":
            assert changed == n and enc.kind == FULL
        decode_(receiver, enc.kind, enc.changed, enc.payload)
        assert torch.equal(_bits(receiver), _bits(new))
        assert checksum(receiver) == checksum(new)
        sender_ref.copy_(new)
        kinds.add(enc.kind)
    if n >= 4096:  # sparse, medium and dense updates all occur
        assert kinds == {FULL, INDEX, BITMASK}, kinds


def test_choose_encoding_is_the_smallest():
    for n in (1, 8, 9, 1000):
        for k in range(0, n + 1, max(1, n // 50)):
            sizes = {kind: encoded_nbytes(kind, n, k) for kind in (FULL, INDEX, BITMASK)}
            assert sizes[choose_encoding(n, k)] == min(sizes.values())
    assert encoded_nbytes(BITMASK, 9, 2) == 2 + 4 and encoded_nbytes(INDEX, 9, 2) == 12


def test_signed_zero_and_nan_payloads_count_as_changes():
    ref = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = ref.clone()
    new.view(torch.int16)[0] = -32768  # -0.0 == 0.0 as floats, not as bits
    new.view(torch.int16)[1] ^= 1  # another NaN payload
    enc = encode(ref, new)
    assert enc.changed == 2
    out = ref.clone()
    decode_(out, enc.kind, enc.changed, enc.payload)
    assert torch.equal(_bits(out), _bits(new))


def test_misaligned_payload_slice_decodes():
    ref = torch.zeros(9, dtype=torch.bfloat16)
    new = ref.clone()
    new[::2] = 1.0  # 5 of 9 changed: bitmask (2 + 10 B) beats index (30 B) and full (18 B)
    enc = encode(ref, new)
    assert enc.kind == BITMASK
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), enc.payload])  # odd offset
    decode_(ref, enc.kind, enc.changed, buf[1:])
    assert torch.equal(_bits(ref), _bits(new))


def test_bad_input_refused():
    a = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not contiguous"):
        encode(a[::2], a[::2].clone())
    with pytest.raises(ValueError, match="16-bit float"):
        encode(a.float(), a.float())
    with pytest.raises(ValueError, match="differ"):
        encode(a, a[:8].clone())
    with pytest.raises(ValueError, match="1-D"):
        encode(a.view(4, 4), a.view(4, 4))
    with pytest.raises(ValueError, match="must be 2 uint8 bytes"):  # FULL of 1 element
        decode_(a[:1].clone(), FULL, 1, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous 16- or 32-bit"):
        checksum(a.view(4, 4).t())


def _checksum_ref(t: torch.Tensor) -> tuple[int, int]:
    """The module docstring's definition in Python integers (independent of the blockwise
    torch computation)."""
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    raw += bytes(-len(raw) % 8)
    words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    s1 = sum(words) % 2**64
    s2 = sum((j + 1) * w for j, w in enumerate(words)) % 2**64

    def signed(v: int) -> int:
        return v - 2**64 if v >= 2**63 else v

    return signed(s1), signed(s2)


@pytest.mark.parametrize("n", [1, 3, 4, 1001, 4 * 1024 * 3 + 6])  # a tail word, blocks + tail
def test_checksum_reference(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g).to(torch.bfloat16)
    assert checksum(t) == _checksum_ref(t)
    assert checksum(t[1:]) == _checksum_ref(t[1:])  # misaligned start: copied first
    big = torch.randint(-(2**31), 2**31 - 1, (4099,), dtype=torch.int32, generator=g)
    assert checksum(big) == _checksum_ref(big)  # the sums wrap mod 2^64


@pytest.mark.parametrize("n", [0, 1, 5, 4096, 1823 * 7 + 3])
def test_changed_positions_host_path_matches_torch_ops(n):
    """On the CPU positions come from numpy; the torch ops (CUDA's path) give the same."""
    g = torch.Generator().manual_seed(n)
    old = torch.randn(n + 1, generator=g).to(torch.bfloat16)
    for frac in (0.0, 0.02, 0.5, 1.0):
        new = old.clone()
        flip = torch.rand(n + 1, generator=g) < frac
        new[flip] = -new[flip]
        for lo in (0, 1):  # word-aligned, and a misaligned view (element by element)
            a, b = old[lo : lo + n].view(torch.int16), new[lo : lo + n].view(torch.int16)
            for q in {0, n // 4 if lo == 0 else 0}:
                host = _changed_host(a.numpy(), b.numpy(), q)
                want = torch.nonzero(a != b).view(-1)
                assert torch.equal(_changed_torch(a, b, q), want), (n, frac, lo, q)
                assert np.array_equal(host, want.numpy()), (n, frac, lo, q)
            assert torch.equal(changed_positions(old[lo : lo + n], new[lo : lo + n]), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_checksum_combined_from_word_aligned_pieces(dtype):
    """A receiver checksums bucket by bucket: the pieces' sums give the whole's, wrapping
    mod 2^64, with a ragged last piece (zero-padded like the whole's last word)."""
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(3 * 1024 * 4 + 4 * 37 + 3, generator=g) * 1e30).to(dtype)
    isz = t.element_size()
    for size in (4, 8, 1024 * 4, 300, 4 * 1025):
        if not word_aligned(size, isz):
            continue
        cuts = list(range(0, t.numel(), size)) + [t.numel()]
        parts = [(a * isz // 8, checksum(t[a:b])) for a, b in zip(cuts, cuts[1:])]
        assert combine_checksums(parts) == checksum(t) == _checksum_ref(t), size
    assert word_aligned(300, 2) and not word_aligned(301, 2) and not word_aligned(2, 2)
    assert word_aligned(2, 4) and not word_aligned(3, 4)


def test_checksum_sensitivity():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(1001, generator=g).to(torch.bfloat16)
    for i, j in ((0, 4), (0, 1)):  # other words: same s1, other s2; one word: other s1
        swapped = t.clone()
        swapped[[i, j]] = t[[j, i]]
        assert t[i] != t[j]
        same_word = i // 4 == j // 4
        assert (checksum(swapped)[0] == checksum(t)[0]) != same_word
        assert checksum(swapped)[1] != checksum(t)[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checksum_and_codec_same_on_cuda():
    g = torch.Generator().manual_seed(4)
    ref = torch.randn(70001, generator=g).to(torch.bfloat16)
    new = ref.clone()
    new[::37] += 0.01
    assert checksum(ref.cuda()) == checksum(ref)
    enc_c, enc_g = encode(ref, new), encode(ref.cuda(), new.cuda())
    assert enc_c.kind == enc_g.kind and torch.equal(enc_c.payload, enc_g.payload.cpu())
    out = ref.cuda()
    decode_(out, enc_g.kind, enc_g.changed, enc_g.payload)
    assert torch.equal(_bits(out.cpu()), _bits(new))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_bitmask_packing_matches_numpy(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < 0.3
    want = np.packbits(mask.numpy(), bitorder="little")
    assert np.array_equal(_pack_bits(mask).numpy(), want)
    assert torch.equal(_unpack_bits(_pack_bits(mask), n), mask)
    assert np.array_equal(
        _pack_bits(mask[1:]).numpy(), np.packbits(mask[1:].numpy(), bitorder="little")
    )


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 1001, 1 << 16])
@pytest.mark.parametrize("frac", [0.0, 0.02, 0.3, 1.0])
def test_changed_positions_match_elementwise_compare(n, frac):
    g = torch.Generator().manual_seed(n)
    ref = torch.randn(n, generator=g).to(torch.bfloat16)
    new = ref.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] = torch.randn(int(hit.sum()), generator=g).to(torch.bfloat16)
    new[: min(n, 2)] = -ref[: min(n, 2)]  # sign flips (and -0.0 vs 0.0) are changes too
    want = (ref.view(torch.int16) != new.view(torch.int16)).nonzero().view(-1)
    assert torch.equal(changed_positions(ref, new), want)
    # a view starting mid-word (not 64-bit aligned) goes element by element
    want1 = (ref[1:].view(torch.int16) != new[1:].view(torch.int16)).nonzero().view(-1)
    assert torch.equal(changed_positions(ref[1:], new[1:]), want1)
    assert changed_positions(ref, new).dtype == torch.int64

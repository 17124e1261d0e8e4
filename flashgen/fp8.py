"""FP8 (e4m3) inputs for ``dtype: fp8_e4m3`` specs: :func:`quantize` (per-``[B, Hkv]`` or
per-block amax scaling, optionally after FlashAttention-3's incoherent processing),
:func:`dequantize` (what the descales mean) and :func:`round_e4m3` (e4m3 rounding, for
emulating the kernel in float32 / float64).

An fp8 op takes q, k, v as ``torch.float8_e4m3fn`` and ``q_descale``, ``k_descale``,
``v_descale`` in one of two forms.  float32 ``[B, Hkv]`` (FlashAttention-3's FP8 interface):
the attention runs on the dequantized inputs ``x[b, h] * x_descale[b, h // (H / Hkv)]``, so
query head ``h`` uses the descale of its kv head ``h // (Hq / Hkv)``.  Per block
(:data:`BLOCK_ROWS` = 128 rows): ``q_descale`` float32 ``[B, Hq, ceil(Sq / 128)]``,
``k_descale`` and ``v_descale`` ``[B, Hkv, ceil(Sk / 128)]``, and row ``s`` of head ``h`` is
``x[b, h, s] * x_descale[b, h, s // 128]`` (FlashAttention-3's block quantization, section
3.3; ``quantize(block_rows=128)``).

Incoherent processing (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention
with Asynchrony and Low-precision", section 3.3): q and k are multiplied by the same random
orthogonal matrix ``M = diag(s) H / sqrt(D)`` (``s`` a random +-1 vector, ``H`` the D x D
Sylvester-Hadamard matrix), so ``(q M)(k M)^T = q k^T`` while an outlier of one head_dim
coordinate is spread over all of them, which shrinks the amax and with it the quantization
error of every other entry.  FlashAttention-3's repository does not ship this step.

Imports torch (not imported by ``import flashgen``).
"""

from __future__ import annotations

import math

import torch

from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError

#: Largest finite ``torch.float8_e4m3fn`` value: amax scaling maps each ``[b, h_kv]`` slice's
#: largest magnitude onto it.
E4M3_MAX = 448.0
#: Smallest normal float32: descales are kept at or above it (a subnormal descale would be
#: flushed to zero by the kernels' arithmetic, and ``448 / amax`` overflows below it).
F32_MIN_NORMAL = 2.0**-126
#: torch's e4m3 dtype (FlashAttention-3's and Hopper's FP8 format: 4 exponent bits, 3
#: mantissa bits, no infinities).
E4M3 = torch.float8_e4m3fn
#: Rows per descale of the per-block form (``quantize(block_rows=BLOCK_ROWS)``): one descale
#: per 128 rows of each head of q, k and v, the fp8 Hopper forward's query tile and a multiple
#: of its key tile (:data:`flashgen.frontend.ir.FP8_DESCALE_BLOCK`).
BLOCK_ROWS = ir.FP8_DESCALE_BLOCK


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest e4m3 value (round to nearest even, saturating at +-448),
    returned in ``x``'s dtype (float32 or float64): an emulation of the kernel's conversions
    to FP8 (of the inputs by :func:`quantize`, of P before the P V product)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(x.dtype)


def hadamard_matrix(n: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix ``H_n / sqrt(n)`` ([n, n], orthogonal and
    symmetric; ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``).  ``n`` must be a power
    of two, a Python int (else :class:`OpInputError`)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise OpInputError(f"hadamard: expected a power-of-two int size, got {n!r}")
    if n < 1 or n & (n - 1):
        raise OpInputError(f"hadamard: expected a power-of-two size, got {n}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


#: Head dims ``quantize(hadamard=True)`` and :func:`incoherence_matrix` take: the kernels'
#: head dims (:data:`flashgen.frontend.ir.SUPPORTED_HEAD_DIMS`) that are powers of two.
HADAMARD_HEAD_DIMS = tuple(d for d in ir.SUPPORTED_HEAD_DIMS if d & (d - 1) == 0)


def _check_hadamard_head_dim(name: str, d) -> None:
    """Refuse a head dim outside :data:`HADAMARD_HEAD_DIMS` before anything is allocated
    (a ``D x D`` matrix of D = 65536 took 4.7 GiB before the call failed elsewhere)."""
    if isinstance(d, bool) or not isinstance(d, int) or d not in HADAMARD_HEAD_DIMS:
        raise OpInputError(
            f"{name}: hadamard=True needs a power-of-two head_dim the kernels take (one of "
            f"{HADAMARD_HEAD_DIMS}; a Hadamard transform along it), got {d!r}"
        )


def incoherence_matrix(head_dim: int, *, generator=None, device=None) -> torch.Tensor:
    """FlashAttention-3's random orthogonal ``M = diag(s) H / sqrt(D)`` (section 3.3): ``s``
    uniform random signs (from ``generator``, else torch's default generator), ``H`` the
    Sylvester-Hadamard matrix of :func:`hadamard_matrix`.  float32 [D, D] on ``device``.
    Raises :class:`OpInputError` unless ``head_dim`` is one of :data:`HADAMARD_HEAD_DIMS`
    and ``generator`` None or a ``torch.Generator``."""
    _check_hadamard_head_dim("head_dim", head_dim)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise OpInputError(
            f"generator: expected None or a torch.Generator (e.g. "
            f"torch.Generator().manual_seed(0)), got {type(generator).__name__}"
        )
    h = hadamard_matrix(head_dim)
    where = generator.device if generator is not None else "cpu"
    bits = torch.randint(0, 2, (head_dim,), generator=generator, device=where)
    signs = (bits.to("cpu", torch.float32) * 2 - 1).unsqueeze(1)
    return (signs * h).to(device=device)


def _check(q, k, v) -> tuple[int, int]:
    """(heads_q, heads_kv) of 4-D floating q, k, v of consistent shapes on one device; else
    :class:`OpInputError` naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise OpInputError(
                f"{name}: expected a 4-D tensor [batch, heads, seqlen, head_dim], got shape "
                f"{list(t.shape)}"
            )
        if not t.is_floating_point() or t.dtype in (E4M3, torch.float8_e5m2):
            raise OpInputError(
                f"{name}: expected a float32, float16 or bfloat16 tensor to quantize, got "
                f"{t.dtype}"
            )
        if t.device != q.device:
            raise OpInputError(f"{name}: expected device {q.device} (q's device), got {t.device}")
    b, hq, _, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise OpInputError(
            f"k: expected [batch, *, *, head_dim] = [{b}, *, *, {d}] (q's), got {list(k.shape)}"
        )
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise OpInputError(
            f"v: expected [batch, heads_kv, seqlen_k] = {list(k.shape[:3])} (k's), got "
            f"{list(v.shape[:3])}"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise OpInputError(
            f"q: expected num_heads to be a multiple of k's num_heads_kv {hkv}, got {hq}"
        )
    return hq, hkv


def _amax(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """float32 [B, Hkv]: max |x| over each kv head's group of heads, its rows and columns."""
    b, h = x.shape[0], x.shape[1]
    if x.numel() == 0:
        return torch.zeros((b, hkv), dtype=torch.float32, device=x.device)
    a = x.abs().amax(dim=(2, 3)).float()  # [B, H]
    return a.view(b, hkv, h // hkv).amax(dim=2)


def _block_amax(x: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 [B, H, ceil(S / rows)]: max |x| over each block of ``rows`` rows of a head (the
    last block the rows left over) and its columns."""
    b, h, s, d = x.shape
    n = -(-s // rows)
    if x.numel() == 0:
        return torch.zeros((b, h, n), dtype=torch.float32, device=x.device)
    a = x.abs().amax(dim=3)  # [B, H, S]
    a = torch.nn.functional.pad(a, (0, n * rows - s))  # |x| >= 0: zero rows change no max
    return a.view(b, h, n, rows).amax(dim=3).float()


def _descales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(descale, scale) of float32 amaxes (any shape): ``amax / 448`` and ``448 / amax``,
    1.0 for a zero amax, the descale at least :data:`F32_MIN_NORMAL`."""
    ok = amax > 0
    # descale >= the smallest normal float32: for a slice whose amax is below 448 times it
    # (about 5.3e-36), amax / 448 would be subnormal and 448 / amax overflow to inf (inf * 0
    # = NaN), so such a slice keeps the smallest normal descale and uses less of e4m3's range
    tiny = ok & (amax / E4M3_MAX < F32_MIN_NORMAL)
    one = torch.ones_like(amax)
    descale = torch.where(ok, (amax / E4M3_MAX).clamp_min(F32_MIN_NORMAL), one)
    scale = torch.where(ok & ~tiny, E4M3_MAX / torch.where(ok, amax, one), 1.0 / descale)
    return descale, scale


def _check_finite(name: str, amax: torch.Tensor) -> None:
    if amax.device.type == "cpu" and not bool(torch.isfinite(amax).all()):
        raise OpInputError(f"{name}: expected finite values to quantize, got inf or NaN")


def _scaled(name: str, x: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [B, H, S, D] contiguous, float32 descale [B, Hkv]) of float32 ``x``."""
    amax = _amax(x, hkv)
    _check_finite(name, amax)
    descale, scale = _descales(amax)
    b, h = x.shape[0], x.shape[1]
    per_head = scale.repeat_interleave(h // hkv, dim=1).view(b, h, 1, 1)
    x8 = (x * per_head).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8.contiguous(), descale.contiguous()


def _scaled_blocks(name: str, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [B, H, S, D] contiguous, float32 descale [B, H, ceil(S / rows)]) of float32
    ``x``: each block of ``rows`` rows of a head scaled on its own."""
    amax = _block_amax(x, rows)
    _check_finite(name, amax)
    descale, scale = _descales(amax)
    per_row = scale.repeat_interleave(rows, dim=2)[:, :, : x.shape[2]].unsqueeze(3)
    x8 = (x * per_row).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8.contiguous(), descale.contiguous()


def check_block_rows(block_rows) -> None:
    """``block_rows`` is None (descales per ``[B, Hkv]``) or :data:`BLOCK_ROWS`; else
    :class:`OpInputError` naming the argument, what it takes and the value received."""
    if block_rows is None or (
        isinstance(block_rows, int) and not isinstance(block_rows, bool)
        and block_rows == BLOCK_ROWS
    ):  # fmt: skip
        return
    raise OpInputError(
        f"block_rows: expected None (one descale per [batch, kv head]) or {BLOCK_ROWS} (one "
        f"per {BLOCK_ROWS} rows of each head: the fp8 kernel's query tile), got {block_rows!r}"
    )


def quantize(q, k, v, *, hadamard: bool = False, generator=None, block_rows: int | None = None):
    """Quantize attention inputs to e4m3 with per-``[B, Hkv]`` or per-block amax scaling.

    ``q`` [B, Hq, Sq, D], ``k`` [B, Hkv, Sk, D], ``v`` [B, Hkv, Sk, Dv]: float32, float16
    or bfloat16 on one device, any strides, Hq % Hkv == 0.  Each ``[b, h_kv]`` slice of k
    and v, and of q the ``Hq / Hkv`` query heads of kv head ``h_kv`` together, is scaled so
    its largest magnitude becomes :data:`E4M3_MAX` (448), rounded to e4m3 (nearest even),
    and its descale is ``amax / 448`` (1.0 for an all-zero slice; at least
    :data:`F32_MIN_NORMAL`, so a slice of amax below about 5.3e-36 maps onto less than 448):
    ``x ~= dequantize(x8, x_descale)``.

    ``block_rows=128`` (:data:`BLOCK_ROWS`, the one block size; None, the default, is the
    ``[B, Hkv]`` form above): each block of 128 rows of each head (the last one the rows
    left over) is scaled on its own, its largest magnitude mapped onto 448, so an outlier
    costs the precision of its own block only (FlashAttention-3's block quantization,
    section 3.3).  The descales are float32 ``q_descale [B, Hq, ceil(Sq / 128)]`` (per query
    head, not per kv head) and ``k_descale``, ``v_descale [B, Hkv, ceil(Sk / 128)]``, the
    per-block form an fp8 op takes (row ``s`` of head ``h`` is ``x[b, h, s] *
    x_descale[b, h, s // 128]``).  With ``hadamard=True`` the rotation comes first.

    ``hadamard=True``: first apply FlashAttention-3's incoherent processing (Shah et al.
    2024, section 3.3): q and k both multiplied (in float32) by one random orthogonal
    ``M = diag(s) H / sqrt(D)`` (:func:`incoherence_matrix`, signs drawn from ``generator``
    or torch's default generator), so ``q k^T`` and hence the attention output are
    unchanged up to float32 rounding, while outliers are spread over head_dim; ``v`` is not
    transformed.  Needs a power-of-two head_dim the kernels take
    (:data:`HADAMARD_HEAD_DIMS`: 32, 64, 128, 256), checked before anything is allocated.

    Returns ``(q8, k8, v8, q_descale, k_descale, v_descale)``: ``torch.float8_e4m3fn``
    tensors shaped like the inputs (contiguous) and float32 descales (contiguous; ``[B,
    Hkv]``, or per block as above), all on the inputs' device: the arguments of an fp8 op,
    ``op.attention(q8, k8, v8, q_descale=..., k_descale=..., v_descale=...)``.

    Raises :class:`OpInputError` naming the argument for a non-tensor, a tensor that is not
    4-D or not float32 / float16 / bfloat16, another device, inconsistent shapes, a head_dim
    outside :data:`HADAMARD_HEAD_DIMS` with ``hadamard=True``, a ``generator`` that is not a
    ``torch.Generator``, a ``block_rows`` other than None and 128, and (CPU tensors; on a
    GPU this would cost a device sync, and the descales come out non-finite instead) inf or
    NaN entries.
    """
    check_block_rows(block_rows)
    _, hkv = _check(q, k, v)
    if hadamard:  # before any allocation
        _check_hadamard_head_dim("q", q.shape[3])
    qf, kf, vf = q.float(), k.float(), v.float()
    if hadamard:
        d = q.shape[3]
        m = incoherence_matrix(d, generator=generator, device=q.device)
        qf, kf = torch.matmul(qf, m), torch.matmul(kf, m)
    if block_rows is not None:
        q8, qd = _scaled_blocks("q", qf, block_rows)
        k8, kd = _scaled_blocks("k", kf, block_rows)
        v8, vd = _scaled_blocks("v", vf, block_rows)
        return q8, k8, v8, qd, kd, vd
    q8, qd = _scaled("q", qf, hkv)
    k8, kd = _scaled("k", kf, hkv)
    v8, vd = _scaled("v", vf, hkv)
    return q8, k8, v8, qd, kd, vd


def block_count(seqlen: int) -> int:
    """Descales per head of a sequence of ``seqlen`` rows in the per-block form:
    ``ceil(seqlen / 128)`` (:data:`BLOCK_ROWS`)."""
    return -(-seqlen // BLOCK_ROWS)


def dequantize(x8: torch.Tensor, descale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``x8 * descale`` in ``dtype``: ``x8`` [B, H, S, D] (e4m3, or any float dtype) and
    ``descale`` on ``x8``'s device, either ``[B, Hkv]`` with H % Hkv == 0 (head ``h`` takes
    ``descale[:, h // (H / Hkv)]``) or per block ``[B, H, ceil(S / 128)]`` (row ``s`` of head
    ``h`` takes ``descale[:, h, s // 128]``).  What the fp8 ops compute on.  Raises
    :class:`OpInputError` naming the argument for a non-tensor, an ``x8`` that is not 4-D, a
    ``descale`` that is not a floating tensor on ``x8``'s device of one of those shapes."""
    if not isinstance(x8, torch.Tensor) or x8.dim() != 4:
        raise OpInputError(
            f"x8: expected a 4-D tensor [batch, heads, seqlen, head_dim], got "
            f"{list(x8.shape) if isinstance(x8, torch.Tensor) else type(x8).__name__}"
        )
    b, h, s = x8.shape[0], x8.shape[1], x8.shape[2]
    if not isinstance(descale, torch.Tensor):
        raise OpInputError(
            f"descale: expected a float32 tensor [batch, heads_kv] (batch {b}) or [batch, "
            f"heads, ceil(seqlen / {BLOCK_ROWS})], got {type(descale).__name__}"
        )
    if not descale.is_floating_point() or descale.device != x8.device:
        raise OpInputError(
            f"descale: expected a float32 tensor on {x8.device} (x8's device), got "
            f"{descale.dtype} on {descale.device}"
        )
    if descale.dim() == 3:
        want = [b, h, block_count(s)]
        if list(descale.shape) != want:
            raise OpInputError(
                f"descale: expected the per-block shape [batch, heads, ceil(seqlen / "
                f"{BLOCK_ROWS})] = {want} (x8's), got {list(descale.shape)}"
            )
        rows = descale.to(dtype).repeat_interleave(BLOCK_ROWS, dim=2)[:, :, :s]
        return x8.to(dtype) * rows.unsqueeze(3)
    hkv = descale.shape[1] if descale.dim() == 2 else 0
    if descale.dim() != 2 or descale.shape[0] != b or hkv == 0 or h % hkv:
        raise OpInputError(
            f"descale: expected shape [batch, heads_kv] = [{b}, a divisor of x8's {h} heads] "
            f"or the per-block [batch, heads, ceil(seqlen / {BLOCK_ROWS})] = "
            f"{[b, h, block_count(s)]}, got {list(descale.shape)}"
        )
    per_head = descale.to(dtype).repeat_interleave(h // hkv, dim=1).view(b, h, 1, 1)
    return x8.to(dtype) * per_head

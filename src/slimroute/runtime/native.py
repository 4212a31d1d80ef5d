"""slimroute's native kernels (kernels.c): built once per machine with the C compiler and OpenMP, loaded with ctypes.

Between an int8 model's GEMMs the eager path runs dozens of small torch ops per decoder layer; kernels.c does each
stretch in one pass over the rows (the residual add and the RMSNorm and the row quantisation; the GEMM's scaling, the
bias, the rotary embedding and the key / value writes; the attention and the quantisation after it; the gated MLP's
middle). `native()` builds the library for the vector ISA torch runs at here (torch.backends.cpu capability, which
ATEN_CPU_CAPABILITY holds down: AVX-512, AVX2 or plain) into slimroute's cache, keyed by the source, the ISA and the
compiler, and checks the kernels that must give torch's bits against torch on a probe (ATen's RMSNorm sums in a
cascade whose shape follows the vector width; kernels.c replays it). Where there is no compiler, the build or a probe
fails, or SLIMROUTE_COMPILE=0, it is None (with a one-line note) and the int8 model runs its eager torch ops:
slower, just as batch-invariant.

The wrappers take and return tensors; each call is one C call over all the rows, the rows split over torch's threads
(OpenMP: the same runtime as torch's, libgomp.so.1, loaded once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from slimroute.runtime.cpu import real_flags
from slimroute.runtime.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# torch's CPU capability -> the compiler's ISA flags, and the lanes of ATen's float sum kernel: 8 at every x86
# capability (torch 2.13 registers no AVX-512 variant of it: measured, and checked by probe())
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-DSR_LANES=8"),
    "AVX2": ("-mavx2", "-mfma", "-DSR_LANES=8"),
}
PLAIN = ("-DSR_LANES=8",)
VNNI = ("-mavx512vnni",)  # added to an AVX-512 build on a CPU with AVX-512 VNNI (the output head's dot products)
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c11")

KEY_BLOCK = 16  # kernels.c reads keys 16 at a time: every key buffer's capacity is a multiple of this
_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {
    "sr_quantize": [_i64, _i64, _ptr, _f32, _int, _ptr, _ptr, _int],
    "sr_add_norm_quantize": [_i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _f32, _int, _ptr, _ptr, _ptr, _int],
    "sr_add": [_i64, _i64, _ptr, _ptr, _ptr, _ptr, _int],
    "sr_gated_quantize": [_i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _f32, _int, _ptr, _ptr, _int],
    "sr_qkv_rotary": [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                      _int],
    "sr_attention": [_i64, _ptr, _i64, _i64, _i64, _ptr, _f32, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr,
                     _ptr, _ptr, _i64, _ptr, _ptr, _f32, _int, _ptr, _ptr, _int],
    "sr_q8_head": [_i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int],
}


def _traced(method):
    """A kernel call seen by torch's profiler as `slimroute::<name>` (bench --profile), at no cost when none runs."""
    name = f"slimroute::{method.__name__}"

    @functools.wraps(method)
    def call(*args, **kwargs):
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(name):
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return call


def _ptr_of(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.data_ptr()


def _f32_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {x.dtype} {tuple(x.shape)} "
                         f"(contiguous: {x.is_contiguous()})")
    return x


class Native:
    """The loaded library, its kernels as methods on tensors (shapes in each docstring; rows are the leading dims)."""

    native = True  # (int8.Eager, the torch ops that stand in where this does not build: False)

    def __init__(self, library: ctypes.CDLL, path: Path, capability: str):
        self.library, self.path, self.capability = library, path, capability
        for name, args in SIGNATURES.items():
            getattr(library, name).argtypes = args
            getattr(library, name).restype = None

    @staticmethod
    def _ints(rows: int, width: int, shift: int) -> torch.Tensor:
        return torch.empty(rows, width, dtype=torch.uint8 if shift else torch.float32)

    @_traced
    def to_ints(self, x: torch.Tensor, act_max: int, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, K) fp32 rows -> their integers (M, K) (uint8 q + shift when shift, else floats) and scales (M, 1)."""
        x = _f32_rows(x, "rows")
        rows, width = x.shape
        q, scales = self._ints(rows, width, shift), torch.empty(rows, 1)
        self.library.sr_quantize(rows, width, x.data_ptr(), act_max, shift, q.data_ptr(), scales.data_ptr(),
                                 torch.get_num_threads())
        return q, scales

    @_traced
    def gated_to_ints(self, gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor, act_max: int, shift: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(gate * scale) * (up * scale) (gate, up (M, I): rows of unit stride, e.g. the two halves of one GEMM's
        output; scale (M, 1)) as the down projection's integers (M, I) and row scales (M, 1)."""
        rows, width = gate.shape
        for t, name in ((gate, "gate"), (up, "up")):
            if t.dtype != torch.float32 or t.stride(-1) != 1 or t.shape != gate.shape:
                raise ValueError(f"{name} must be float32 rows of unit stride shaped like gate, got {t.dtype} "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        scale = _f32_rows(scale.reshape(rows), "scale")
        q, scales = self._ints(rows, width, shift), torch.empty(rows, 1)
        self.library.sr_gated_quantize(rows, width, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                                       scale.data_ptr(), act_max, shift, q.data_ptr(), scales.data_ptr(),
                                       torch.get_num_threads())
        return q, scales

    @_traced
    def add_norm_to_ints(self, x: torch.Tensor, weight: torch.Tensor, eps: float, act_max: int, shift: int,
                         delta: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, H) += delta (products (M, H), their row scales (M, 1), a bias (H) or None) in place, then the
        model's RMSNorm of x (weight (H)) as integers (M, H) and row scales (M, 1)."""
        rows, width = x.shape
        q, scales = self._ints(rows, width, shift), torch.empty(rows, 1)
        self._add_norm(x, weight, eps, act_max, shift, q, scales, None, delta)
        return q, scales

    @_traced
    def add_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: tuple | None = None
                 ) -> torch.Tensor:
        """add_norm_to_ints, the norm's output as fp32 (M, H) (the final norm)."""
        out = torch.empty_like(x)
        self._add_norm(x, weight, eps, 0, 0, None, None, out, delta)
        return out

    def _add_norm(self, x, weight, eps, act_max, shift, q, scales, out, delta):
        x = _f32_rows(x, "x")
        rows, width = x.shape
        products, row_scales, bias = delta or (None, None, None)
        self.library.sr_add_norm_quantize(
            rows, width, x.data_ptr(), _ptr_of(products), _ptr_of(row_scales), _ptr_of(bias),
            _f32_rows(weight, "weight").data_ptr(), eps, act_max, shift, _ptr_of(q), _ptr_of(scales), _ptr_of(out),
            torch.get_num_threads())

    @_traced
    def add(self, x: torch.Tensor, products: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None
            ) -> None:
        """x (M, H) += products (M, H) * row_scales (M, 1) (+ bias (H)), in place."""
        rows, width = _f32_rows(x, "x").shape
        self.library.sr_add(rows, width, x.data_ptr(), _f32_rows(products, "products").data_ptr(),
                            row_scales.data_ptr(), _ptr_of(bias), torch.get_num_threads())

    @_traced
    def qkv_rotary(self, products, row_scales, bias, cos, sin, heads: int, kv_heads: int, tokens: Tokens, keys_t,
                   values, slots: torch.Tensor) -> torch.Tensor:
        """A fused q/k/v GEMM's products (M, (heads + 2 kv_heads) D) for a pass's tokens times their row scales (M, 1),
        plus bias: the queries rotated (M, heads, D) returned; keys rotated into keys_t (R, kv_heads, D, cap) and
        values into values (R, kv_heads, cap, D), token m at position slots[row] + step of its row. cos, sin (M, D):
        the model's rotary embedding at the tokens' positions."""
        count, width = _f32_rows(products, "products").shape
        d = width // (heads + 2 * kv_heads)
        queries = torch.empty(count, heads, d)
        self.library.sr_qkv_rotary(count, heads, kv_heads, d, products.data_ptr(), row_scales.data_ptr(),
                                   _ptr_of(bias), _f32_rows(cos, "cos").data_ptr(), _f32_rows(sin, "sin").data_ptr(),
                                   tokens.rows.data_ptr(), tokens.steps.data_ptr(), queries.data_ptr(),
                                   keys_t.data_ptr(), values.data_ptr(), keys_t.shape[-1], slots.data_ptr(),
                                   torch.get_num_threads())
        return queries

    @_traced
    def attention(self, queries: torch.Tensor, row_starts: torch.Tensor, kv_heads: int, scaling: float, runs: list,
                  act_max: int = 0, shift: int = 0):
        """queries (M, heads, D), the tokens of R rows packed (row r's are row_starts[r]:row_starts[r + 1]), over up to
        three runs of keys, in order (kernels.c sr_attention): runs[0] (keys_t (kv_heads, D, cap), values, count)
        shared by every row; runs[1] (keys_t (Rb, kv_heads, D, cap), values, counts (M,)): row r reads row r % Rb;
        runs[2] (keys_t (R, ...), values, counts (M,)). A run may be None. Returns out (M, heads*D), or, with
        act_max, its rows as integers and scales for o_proj."""
        count, heads, d = _f32_rows(queries, "queries").shape
        a, b, c = (list(runs) + [None, None, None])[:3]
        for run in (a, b, c):
            if run is not None:
                _f32_rows(run[0], "keys_t"), _f32_rows(run[1], "values")
                if run[0].shape[-1] % KEY_BLOCK or run[1].shape[-2] != run[0].shape[-1]:
                    raise ValueError(f"key and value buffers hold one multiple of {KEY_BLOCK} positions, got "
                                     f"{run[0].shape[-1]} and {run[1].shape[-2]}")
        out = torch.empty(count, heads * d)
        q, scales = (self._ints(count, heads * d, shift), torch.empty(count, 1)) if act_max else (None, None)
        self.library.sr_attention(
            row_starts.shape[0] - 1, row_starts.data_ptr(), heads, kv_heads, d, queries.data_ptr(), scaling,
            _ptr_of(a[0]) if a else None, _ptr_of(a[1]) if a else None, a[0].shape[-1] if a else 0, a[2] if a else 0,
            _ptr_of(b[0]) if b else None, _ptr_of(b[1]) if b else None, b[0].shape[-1] if b else 0,
            b[0].shape[0] if b else 1, _ptr_of(b[2]) if b else None,
            _ptr_of(c[0]) if c else None, _ptr_of(c[1]) if c else None, c[0].shape[-1] if c else 0,
            _ptr_of(c[2]) if c else None,
            out.data_ptr(), act_max, shift, _ptr_of(q), _ptr_of(scales), torch.get_num_threads())
        return (q, scales) if act_max else out

    @_traced
    def q8_head(self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x (M, K) fp32 rows -> their logits (M, tiles * 16) against an output head packed by output_head.pack_q8:
        weights (tiles, K / 2, 16, 2) int8, scales (tiles, K / 32, 16) fp32 (kernels.c sr_q8_head)."""
        rows, width = _f32_rows(x, "x").shape
        tiles = weights.shape[0]
        if weights.dtype != torch.int8 or not weights.is_contiguous() or weights.numel() != tiles * width * 16:
            raise ValueError(f"weights must be ({tiles}, {width // 2}, 16, 2) contiguous int8, got {weights.dtype} "
                             f"{tuple(weights.shape)}")
        if _f32_rows(scales, "scales").numel() != tiles * (width // 32) * 16 or width % 32:
            raise ValueError(f"scales must be ({tiles}, {width // 32}, 16) for {width}-wide rows (a multiple of 32)")
        out = torch.empty(rows, tiles * 16)
        self.library.sr_q8_head(rows, width, x.data_ptr(), tiles, weights.data_ptr(), scales.data_ptr(),
                                out.data_ptr(), torch.get_num_threads())
        return out


@dataclass(frozen=True)
class Tokens:
    """A pass's tokens packed, without padding: row (R rows) and step within the row's part of the pass of each
    token (M,), and row_starts (R + 1,): row r's tokens are row_starts[r]:row_starts[r + 1]."""

    rows: torch.Tensor
    steps: torch.Tensor
    row_starts: torch.Tensor

    @classmethod
    def of_lengths(cls, lengths: torch.Tensor) -> Tokens:
        """The tokens of rows of these lengths (R,), in row order."""
        lengths = lengths.to(torch.int64)
        row_starts = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=row_starts[1:])
        rows = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
        steps = torch.arange(int(row_starts[-1])) - row_starts[rows]
        return cls(rows.contiguous(), steps.contiguous(), row_starts)


_LOADED: list[Native | None] = []


def native() -> Native | None:
    """The native kernels for this CPU's vector ISA, built (once per machine) and checked (once per process); None
    where they cannot run here (one-line note) or SLIMROUTE_COMPILE=0."""
    if not _LOADED:
        kernels = None
        if os.environ.get("SLIMROUTE_COMPILE", "1") != "0":
            try:
                kernels = _load()
                if problem := probe(kernels):
                    raise RuntimeError(problem)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("int8: slimroute's native kernels do not run here (%s); eager torch ops run instead "
                            "(slower, as batch-invariant)", str(exc).strip().splitlines()[0][:200])
                kernels = None
        _LOADED.append(kernels)
    return _LOADED[0]


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise RuntimeError("no C compiler found (set CC, or install gcc)")


def _load() -> Native:
    capability = torch.backends.cpu.get_cpu_capability()
    vnni = capability == "AVX512" and "avx512_vnni" in real_flags()
    isa = ISA_FLAGS.get(capability, PLAIN) + (VNNI if vnni else ())
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS + isa), version]).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"kernels-{key}-{platform.machine()}-{capability.lower()}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, *isa, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:300]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return Native(ctypes.CDLL(str(path)), path, capability)


def probe(kernels: Native) -> str:
    """"" when the kernels that must give torch's bits do (RMSNorm, on widths that take every branch of ATen's
    cascade sum at this ISA, and the residual add), else what differs."""
    generator = torch.Generator().manual_seed(0)
    for rows, width in ((1, 16), (3, 40), (5, 896), (2, 1000), (2, 4864), (3, 2048)):
        x = torch.randn(rows, width, generator=generator) * 3
        delta = torch.randn(rows, width, generator=generator)
        scale, weight = torch.rand(rows, 1, generator=generator), torch.randn(width, generator=generator)
        expected = x + delta * scale
        expected = weight * (expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6))
        got_x = x.clone()
        got = kernels.add_norm(got_x, weight, 1e-6, (delta, scale, None))
        if not (torch.equal(got_x, x + delta * scale) and torch.equal(got, expected)):
            return f"its RMSNorm differs from torch's on {rows} x {width} rows"
    return ""

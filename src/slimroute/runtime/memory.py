"""Memory handed back to the system: a packed weight's file pages, glibc's free heap, and one malloc arena for the
server's worker thread. Each is what keeps a long-running process's RSS near what it uses."""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch


class FileMappedMemory:
    """Hands back the pages of a weight that was read from a memory-mapped checkpoint once it has been packed.

    transformers loads safetensors through mmap, so an fp32 weight is the file's own pages; packing reads
    them, and they stay in the RSS as long as the mapping lives, which other tensors of the file (the
    embeddings) keep alive: +1.4 GB for the 0.5B model in fp32 (a 4.1 GB peak instead of 2.7 GB).
    madvise(MADV_DONTNEED) drops the clean pages; they would be read from the file again if anything
    touched them, and nothing does: the packed copy replaced the weight. Weights in anonymous memory
    (converted to bf16 at load, say) are left alone: they are freed with the module."""

    MADV_DONTNEED = 4

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.libc = None
        if sys.platform.startswith("linux"):
            try:
                self.libc = ctypes.CDLL(None, use_errno=True)
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].startswith("/"):  # a file, not heap / anon / [vdso]
                            start, end = (int(x, 16) for x in fields[0].split("-"))
                            self.ranges.append((start, end))
            except OSError:
                self.libc = None

    def release(self, weight: torch.Tensor) -> None:
        if self.libc is None or weight.device.type != "cpu":
            return
        start, size, page = weight.data_ptr(), weight.numel() * weight.element_size(), mmap.PAGESIZE
        if not any(lo <= start and start + size <= hi for lo, hi in self.ranges):
            return
        first, last = -(-start // page) * page, (start + size) // page * page  # whole pages inside the weight
        if last > first:
            self.libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), self.MADV_DONTNEED)


def return_freed_memory() -> None:
    """Hand glibc's cached free heap back to the system (malloc_trim): loading and packing weights frees
    hundreds of MB of temporaries that would otherwise stay in the RSS. A no-op where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def share_the_main_malloc_arena() -> None:
    """Let threads started from now on allocate from glibc's main arena (mallopt M_ARENA_MAX = 1).

    In a thread of its own arena, the engine's large activation buffers are mapped fresh and faulted in
    on every batch, which costs throughput (docs/design.md). Process-wide, so only the server,
    whose engine runs in a worker thread, calls it; a no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).mallopt(ctypes.c_int(-8), ctypes.c_int(1))  # -8: M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        pass

"""Run tests under each CPU kind this CPU can be held to: `python tests/cpu_kinds.py [--below] [pytest args]`
(`make test` runs the dtype and kernel tests, `-m kernels`, under every kind below this CPU's own, which the plain
pytest run covers: --below; `make test-cpu-kinds` under all of them).

Each kind (runtime/cpu.py KINDS: AVX2 only, AVX-512 without VNNI, AVX-512 VNNI without BF16, AVX-512 BF16 + VNNI,
AMX) is reproduced with the libraries' own switches (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY,
FBGEMM_ENABLE_INSTRUCTIONS, MKL_ENABLE_INSTRUCTIONS), one pytest process per kind, so a Zen 4 also runs what an Ice
Lake or a Zen 3 would. A kind needing flags this CPU lacks is listed as not run, with the flags it lacks (under
ONEDNN_MAX_CPU_ISA, those above the cap count as lacking: `ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI make test` is an Ice
Lake's make test, its own kind run by the plain pytest, the kinds below by this script). Exit status:
1 if any kind's run failed (pytest's 5, no tests collected, counts as failed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from slimroute.runtime.cpu import KINDS, detect


def main(args: list[str]) -> int:
    below = "--below" in args
    pytest_args = [arg for arg in args if arg != "--below"]
    cpu = detect()  # under ONEDNN_MAX_CPU_ISA, the CPU it holds oneDNN to: the kinds above it are not run
    own = [kind for kind in KINDS if kind.fits(cpu)][-1:]  # this CPU's own kind: the plain run covers it
    rows, failed = [], False
    for kind in KINDS:
        if below and kind in own:
            rows.append((kind.name, kind.examples, "this CPU's own kind: run by the plain pytest"))
            continue
        if not kind.fits(cpu):
            lacks = " ".join(sorted(kind.needs - cpu.flags))
            held = f" (oneDNN held to {cpu.onednn_cap})" if cpu.onednn_cap else ""
            rows.append((kind.name, kind.examples, f"not run: this CPU lacks {lacks}{held}"))
            continue
        env = {**os.environ, **dict(kind.settings)}
        settings = " ".join(f"{k}={v}" for k, v in kind.settings)
        print(f"\n=== {kind.name} ({kind.examples}): {settings}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args], env=env,
                               cwd=Path(__file__).resolve().parent.parent)
        failed |= code != 0
        rows.append((kind.name, kind.examples, f"{'passed' if code == 0 else f'FAILED (pytest exit {code})'} in "
                     f"{time.perf_counter() - start:.0f} s"))
    print(f"\nCPU kinds on {cpu.describe()}:")
    for name, examples, result in rows:
        print(f"  {name:<12} {result:<40} {examples}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

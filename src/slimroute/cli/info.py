"""`slimroute info`: what this machine is to slimroute — the CPU, the dtype `auto` picks and why, which dtypes and
kernels work here, the versions, the cache and the packaged models. Loads no model; the kernels are tried on small
layers, as at load. For bug reports: `slimroute info --json`."""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import version

import torch
import transformers
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from slimroute.cli import options as opt
from slimroute.cli import ui
from slimroute.runtime.cpu import cpuid, detect
from slimroute.runtime.dtypes import choose_dtype, exactness, missing_feature, supported_dtypes
from slimroute.runtime.int8 import activation_bits, pick_kernel
from slimroute.runtime.linear import onednn_failure
from slimroute.runtime.native import native
from slimroute.runtime.packaged import PACKAGED_MODELS, packaged_status
from slimroute.runtime.paths import cache_dir
from slimroute.runtime.threads import physical_cores

DTYPES = ("float32", "bfloat16", "int8")
# settings read from the environment that change what slimroute sees or runs (shown when set)
ENVIRONMENT = ("SLIMROUTE_CPU_FLAGS", "SLIMROUTE_CACHE", "SLIMROUTE_COMPILE", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA",
               "ATEN_CPU_CAPABILITY", "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS", "HF_HUB_OFFLINE")
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "avx_ne_convert", "amx_bf16", "amx_int8")


def machine_facts(device: str = "cpu") -> dict:
    """Everything `info` shows, as plain data."""
    cpu = detect()
    works = supported_dtypes(cpu, device)
    choice = choose_dtype("auto", cpu, device)
    return {
        "versions": {"slimroute": version("slimroute"), "python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "cpu": {"model": cpu.model, **cpuid(), "machine": cpu.machine, "torch_capability": cpu.capability,
                "flags": [flag for flag in CPU_FLAGS if flag in cpu.flags], "onednn_held_to": cpu.onednn_cap,
                "physical_cores": physical_cores(),
                "logical_cpus": os.cpu_count()},
        "device": device,
        "dtype_auto": {"name": choice.name, "reason": choice.reason},
        "dtypes": {name: "works" if name in works else missing_feature(name, cpu, device) for name in DTYPES},
        "exactness": {name: str(exactness(name, cpu, device)) for name in DTYPES if name in works},
        "kernels": _kernels(works) if torch.device(device).type == "cpu" else {},
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cache": str(cache_dir()),
        "models": {name: packaged_status(model) for name, model in PACKAGED_MODELS.items()},
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
    }


def _kernels(works: list[str]) -> dict[str, str]:
    """Which special kernel each dtype that works here would run, tried on a small layer as at load."""
    kernels = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if name in works:
            failure = onednn_failure(dtype)
            kernels[name] = f"torch's default kernels (oneDNN's failed: {failure})" if failure else "oneDNN, packed"
    if "int8" in works:
        kernel = pick_kernel()
        between = ("slimroute's native kernels between them" if native() is not None else
                   "torch ops between them (the native kernels do not build here)")
        kernels["int8"] = f"{kernel}'s integer GEMMs, {activation_bits(kernel)}-bit activations, {between}"
    return kernels


def info(
    device: str = opt.DEVICE,
    json_out: bool = typer.Option(False, "--json", help="Print the facts as JSON (for bug reports)."),
):
    """What this machine is to slimroute: the CPU, the dtype --dtype auto picks and why, what works here."""
    try:
        facts = machine_facts(device)
    except (ValueError, RuntimeError) as exc:
        ui.fail(str(exc))
    if json_out:
        typer.echo(json.dumps(facts, indent=2))
        return
    cpu, auto = facts["cpu"], facts["dtype_auto"]
    table = _Rows("", "", show_header=False, box=None)
    table.add_row("slimroute", "  ".join(f"{k} {v}" for k, v in facts["versions"].items()))
    cpuid = f"family {cpu['family']} model {cpu['model_number']}, " if "family" in cpu else ""
    table.add_row("CPU", f"{cpu['model']} ({cpuid}{cpu['machine']}; torch sees {cpu['torch_capability']})")
    cap = cpu["onednn_held_to"]
    held = f" (oneDNN held to {cap}: the flags above it are left out)" if cap else ""
    table.add_row("CPU flags", (", ".join(cpu["flags"]) or "none of AVX2 / AVX-512 / VNNI / AMX") + held)
    table.add_row("cores", f"{cpu['physical_cores']} physical ({cpu['logical_cpus']} logical): the default --threads")
    table.add_row("--dtype auto", f"{auto['name']} ({auto['reason']})")
    for name, state in facts["dtypes"].items():
        kernel = facts["kernels"].get(name)
        works = f"works: {kernel}" if kernel else "works"
        table.add_row(f"  {name}", f"{works}; against its reference: {facts['exactness'][name]}" if state == "works"
                      else state)
    table.add_row("GPU", facts["cuda"] or "none that torch sees (--device cuda needs one)")
    table.add_row("cache", facts["cache"])
    for name, status in facts["models"].items():
        table.add_row(f"  {name}", f"installed: {status['installed']}; converted: {status['converted']}")
    for name, value in facts["environment"].items():
        table.add_row(f"${name}", value)
    Console().print(table)


class _Rows(Table):
    """A table of plain text: a CPU model "[flags simulated by ...]" is not rich markup."""

    def add_row(self, *cells: str) -> None:
        super().add_row(*(Text(cell) for cell in cells))

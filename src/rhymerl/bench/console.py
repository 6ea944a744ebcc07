"""Where bench tables are printed."""

from __future__ import annotations

import platform

import torch
from rich.console import Console


def table_console() -> Console:
    """The terminal's width on a terminal; 240 columns otherwise. Rich assumes 80 columns when stdout is a
    file or a pipe (`rhymerl bench ... | tee log`), which truncates the wide bench tables to unreadable
    stubs."""
    console = Console()
    return console if console.is_terminal else Console(width=240)


def device_fields(device: torch.device | str) -> dict:
    """The bench JSON's description of where it ran: the device, and the CPU threads or the GPU's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"device": "cuda", "gpu": torch.cuda.get_device_name(device)}
    return {"device": device.type, "threads": torch.get_num_threads(), "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), which decides what the kernels can use (AMX, AVX-512)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()

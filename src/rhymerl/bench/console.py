"""Where bench tables are printed."""

from __future__ import annotations

from rich.console import Console


def table_console() -> Console:
    """The terminal's width on a terminal; 240 columns otherwise. Rich assumes 80 columns when stdout is a
    file or a pipe (`rhymerl bench ... | tee log`), which truncates the wide bench tables to unreadable
    stubs."""
    console = Console()
    return console if console.is_terminal else Console(width=240)

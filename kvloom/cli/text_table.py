"""Plain-text tables for the command line (``engine plan``, ``engine bench``)."""

from __future__ import annotations


def format_table(header, rows) -> str:
    """A plain text table, columns right-aligned except the first."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])

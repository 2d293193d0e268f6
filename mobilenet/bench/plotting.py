"""matplotlib for the tools that draw charts (compare.py's matrix, plot_ladder.py's waterfall): headless, and a
clear error naming the extra to install where it is missing."""

from __future__ import annotations

from ..errors import MissingDependency


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed); MissingDependency if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingDependency(f"drawing charts needs matplotlib: pip install -e '.[bench]' ({e})") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

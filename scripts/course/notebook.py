"""The one rule for "am I running in a Jupyter kernel?" (rich HTML output, widgets) — nothing else."""


def in_notebook() -> bool:
    """True inside a Jupyter kernel (a notebook, or JupyterLab's console); False in a plain Python process,
    a terminal IPython, or a test."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")

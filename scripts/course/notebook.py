"""The one rule for "am I running in a Jupyter kernel?" (rich HTML output, widgets) — nothing else. Its home is
``ddp_doctor.report`` (the doctor shows its report as a table in a notebook); the course asks it from here."""

from ddp_doctor.report import in_notebook  # noqa: F401

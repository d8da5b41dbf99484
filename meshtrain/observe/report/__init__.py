"""``meshtrain report``: one self-contained HTML page (report.html) of a run folder."""

from meshtrain.observe.report.render import write_report

__all__ = ["write_report"]

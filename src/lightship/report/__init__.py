"""The accuracy-vs-latency report of every variant in a run (markdown, JSON, plot)."""

from lightship.report.core import ReportSettings, report

__all__ = ["ReportSettings", "report"]

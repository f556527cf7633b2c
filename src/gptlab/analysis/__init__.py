"""The analysis of finished runs: comparison tables with seed statistics, curves, and the length study of a
sweep. Reads runs only through :mod:`gptlab.runs`.

- :mod:`gptlab.analysis.records`: one run's choices and figures; :data:`~gptlab.analysis.records.OUTPUTS`
  declares the evaluation outputs that become table columns.
- :mod:`gptlab.analysis.table`: runs grouped by choice, ordered by the metric, and the markdown table.
- :mod:`gptlab.analysis.stats`: Welch's t-test and the verdict a table cell gives.
- :mod:`gptlab.analysis.length`: the length evaluations of a sweep, one table and one figure.
- :mod:`gptlab.analysis.compare`: all of it for one sweep directory, written as ``comparison.md``.
"""

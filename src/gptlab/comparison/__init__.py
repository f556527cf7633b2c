"""Comparing runs: what a sweep's runs say side by side. Reads runs only through :mod:`gptlab.runs`; the
evaluation of one trained model is :mod:`gptlab.evaluation`.

- :mod:`gptlab.comparison.records`: one run's choices and figures; :data:`~gptlab.comparison.records.OUTPUTS`
  declares the evaluation outputs that become table columns.
- :mod:`gptlab.comparison.table`: runs grouped by condition, ordered by the metric, and the markdown table.
- :mod:`gptlab.comparison.stats`: Welch's t-test, Holm's adjustment and the verdict a table cell gives.
- :mod:`gptlab.comparison.length_table`: the length evaluations of a sweep, one table and one figure.
- :mod:`gptlab.comparison.scaling`: a power law fitted to the runs of a scaling ladder.
- :mod:`gptlab.comparison.report`: all of it for one sweep directory, written as ``comparison.md``.
"""

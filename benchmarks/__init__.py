"""Side-by-side benchmarks: each script compares implementations in one process and
prints ratios (never a timed test). They are grouped in sub-packages by the question
they answer (``speed``, ``overhead``, ``parallel``, ``checkpoints``, ``device``); what
they share is in ``common``. ``python -m benchmarks`` lists them by group and runs any
subset by short name (:mod:`benchmarks.suite`); they print one table format
(:mod:`benchmarks.common.table`)."""

"""Side-by-side benchmarks: each script compares implementations in one process and
prints ratios (never a timed test). ``python -m benchmarks`` lists them and runs any
subset (:mod:`benchmarks.suite`); they print one table format (:mod:`benchmarks.table`)."""

"""Side-by-side benchmarks: each script compares implementations in one process and
prints ratios (never a timed test)."""

"""What the benchmarks share, and no benchmark: the workloads and the Trainer over
in-memory arrays, the implementations the speed benchmarks compare, the datasets, the
one table format, the interleaved rounds, and the parts that one benchmark runs (a
worker process, the device checks, the checkpoint checksums' measurement).
:mod:`benchmarks.suite` lists nothing from here."""

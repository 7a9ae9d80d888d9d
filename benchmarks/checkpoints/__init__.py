"""What do checkpoints cost, and how do the runs that rely on them fare?

Save and restore times and the training stall, checkpoints in a bucket and preemption,
a campaign of faults, and how far the evaluator trails the checkpoints it reads.
"""

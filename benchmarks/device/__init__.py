"""Do the framework's accelerator paths hold on the GPU or TPU found?

One command that checks devices, replicas, precision, XLA, MFU and checkpoints in a
time budget (at tiny sizes on a CPU).
"""

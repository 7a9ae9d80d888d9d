"""What do the ways of spreading training over devices and hosts gain or cost?

Manual data parallelism against Mirrored, sparse gradients dense or gathered, compressed
all-reduce, and many hosts on shaped links.
"""

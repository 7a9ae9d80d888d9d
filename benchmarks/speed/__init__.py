"""How fast does the framework train, against the loops a user would write and per setting?

The framework's default config against hand-written loops and ``keras fit``, on small
and larger models, per precision policy, thread-pool size and input-pipeline option.
"""

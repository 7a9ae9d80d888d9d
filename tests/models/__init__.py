"""Specs of the example models: the embedded default, the zoo, TFDS input at scale."""

"""Specs of trainer.distribution: 1, 2 and 4 replicas, manual data parallelism and worker
groups train to the same weights, and a lost peer is named."""

"""Specs of trainer.data: resuming the input exactly, and releasing its iterators."""

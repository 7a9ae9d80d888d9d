"""The documentation runs: the guide's commands and the Colab notebook."""

"""Models: the target as the trainer sees it (and its offline set-up), and the drafter architectures."""

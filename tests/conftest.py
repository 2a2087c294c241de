"""Shared test setup: one torch thread per test process (the CI machine has two
cores, and oversubscribed torch threads slow CPU tests by an order of magnitude)."""

import torch

torch.set_num_threads(1)

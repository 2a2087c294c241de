"""The trace data path: sequence and block records, the segment buffer, its writer thread."""

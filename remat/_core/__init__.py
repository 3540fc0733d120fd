"""The bottom layer: node metadata, errors and warnings, the tracing lock, remat's own op, and every private torch API (torch_internals). Imports nothing of remat."""

"""The compiled CPU kernels: their C sources (*.c, *.h) and the Python side that builds and calls them:
`variants` (one build per instruction set, read by setup.py), `loader` (the ctypes ABI and the pick of
the best build, torch-free) and `torch_ops` (the kernels on torch tensors).

The lowest room of semoe/: it imports only `storage`, never another subpackage of semoe."""

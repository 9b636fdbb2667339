"""ElasticDL for PyTorch: elastic, fault-tolerant distributed training on Kubernetes."""

import os as _os

# gRPC's fork handlers are unsafe while other threads are inside gRPC (the PS worker's
# push streams always are): a DataLoader worker process forked then died at random
# ("Other threads are currently calling into gRPC, skipping fork() handlers"; 3 of 4
# loader processes of a GPT-2 PS job, and every try of one task in CI). Processes forked
# from ours never use gRPC, so the handlers are not needed; an explicit setting wins.
# Read when grpc is first imported: set here, before any module of the package imports it.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

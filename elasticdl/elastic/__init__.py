"""The elastic allreduce runtime: the group and its rendezvous client, the runner (the one
retry loop), gradient sync, collectives and the members' trained-record bookkeeping.

Model authors import these through :mod:`elasticdl.api`; the worker's allreduce runtime
(:mod:`elasticdl.worker.allreduce_trainer`) drives them.
"""

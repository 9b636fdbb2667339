"""The Local strategy's wiring: a whole job in one process.

It joins the master's job core (:mod:`elasticdl.master`) to the worker's task loop and
runtimes (:mod:`elasticdl.worker`), so it sits above both; neither imports it.
:func:`elasticdl.local.job.run_local_job` is what ``elasticdl train`` runs for
``--distribution_strategy=Local``; :class:`elasticdl.local.task_source.LocalTaskSource` is
the in-process task source.
"""

"""The ipyparallel executor: one rank per engine of a cluster, when one machine is not enough.

Owns: choosing engines (``engines``: ``Engines``, ``engines_of``), the checks made on the engines
before a run (``engine_checks``: each GPU judged on its engine's host, the interfaces named in
``env=``), how ranks on several hosts reach each other (``network_plan``: the probe, rank 0's
address, each engine's interface), the transport the supervisor drives (``transport``: calls,
data messages and signals through ipyparallel) and the executor (``executor``). Nothing here
imports ipyparallel until a run asks for engines.
"""

"""The ipyparallel backend: one rank per engine of a cluster, when one machine is not enough.

Owns: choosing engines (``engines``: ``Engines``, ``engines_of``), validation on the engines
(``validation``: each GPU judged on its engine's host), the transport the supervisor drives
(``transport``: calls, data messages and signals through ipyparallel) and the backend
(``backend``). Nothing here imports ipyparallel until a run asks for engines.
"""

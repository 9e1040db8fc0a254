"""The data path: how a call and its data travel between the notebook and the ranks, and how a
result and the items of a queue travel back.

Owns: pickling by value with real file names (``pickling``: cloudpickle, so functions defined in
notebook cells travel), packing with large tensors and arrays by reference and placing them once
in shared memory (``packing``: ``pack``, ``Packed``, ``Placement``, memfds), finding what memory
is a file's clean mapping (``file_mappings``: such data stays in its file), mapping it back
copy-on-write in the process that uses it (``loading``: ``load``, ``Received``, ``share``), and
the ``multiprocessing`` queues of a call (``queues``: the worker's end that sends, the
notebook's end that feeds the user's queue).

May import: ``ddp_notebook.core`` (errors), the standard library and cloudpickle. Never torch or
numpy at import time (a tensor is looked for only where torch is already imported).
"""

"""OffloadOptimizer's parts (the class itself is :mod:`pipeoff.optim.offload`).

* ``_args.py``: the optimizer to wrap, given or built in torchao's form, and the
  staging defaults;
* ``_layout.py``: the layout of a step (the live param groups, checked and frozen
  at a step boundary); ``_host_layout.py``: ``HostLayout``, the one writer of the
  layout, the host state in it and the host memory reserved ahead;
  ``_host_state.py``: that state moved to, loaded into and checked in host memory;
* ``_graph_shape.py``: the shape of a step's task graph (also what the simulator
  predicts); ``_graph.py``: the graph with its work (the host part);
* ``_device_part.py``: ``offload_fraction``'s split and the device part, stepped by
  torch's own kernel on the caller's stream; ``_join.py``: the end of a step, the
  join of its two parts and what a failure left;
* ``_check.py``: ``check_overlap``.

What both optimizers share sits beside this folder in ``pipeoff/optim/``
(``_offloaded.py``, ``_update.py``, ``_plan.py``, ``_tensors.py``, ``_waits.py``,
``_hooks.py``, ``_readers.py``, ``_foreign.py``).
"""

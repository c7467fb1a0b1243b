"""The parts of :class:`~pipeoff.optim.FullOffloadOptimizer`, split by concept as FSDP2's
``torch/distributed/fsdp/_fully_shard/`` is.

* ``_config``: the arguments, checked once (a frozen value).
* ``_param``: one parameter's host side (``OffloadedParam``: master, gradient
  accumulator, optimizer state) and the registry that follows ``param_groups``
  and the model (``ParamRegistry``).
* ``_lifecycle``: the micro-step lifecycle (``MicroSteps``): the hooks, one
  execution per backward, the end of each backward, the accumulation's phase
  and the transitions ``step()`` and ``zero_grad()`` drive.
* ``_lanes``: the work that runs on lanes (``LaneWork``: d2h, fold, norm, step
  chunk, h2d), with the fields lanes write and what orders the caller's reads.
* ``_checkpoint``: state dicts, as functions over the registry.
* ``_trainers``: what it says when a trainer drives it unprepared (the HF Trainer).
* ``_graph``: the task graph of a micro-step (``MicroStepPlan``), shared with the
  simulator.

``pipeoff/optim/full_offload.py`` is the thin orchestrator with the
``torch.optim.Optimizer`` surface.
"""

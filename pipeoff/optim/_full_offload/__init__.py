"""The parts of :class:`~pipeoff.optim.FullOffloadOptimizer`, split by concept as FSDP2's
``torch/distributed/fsdp/_fully_shard/`` is.

* ``_config``: the arguments, checked once (a frozen value), and the two forms.
* ``_param``: one parameter's host side (``OffloadedParam``: master, gradient
  accumulator, optimizer state) and the registry that follows ``param_groups``
  and the model (``ParamRegistry``).
* ``_graph``: the task graph of a micro-step (``MicroStepPlan``, shared with the
  simulator) and every task and gate name.
* ``_lanes``: the work that runs on lanes (``LaneWork``: d2h, fold, norm, step
  chunk, h2d), with the fields lanes write and what orders the caller's reads.
* ``_one_pass``: the final micro-step in one pass: the held gradients' buffer
  (``HeldGrads``), their lane work (``HeldWork``), the choice of path
  (``HostStepPath``) and its two waits.
* ``_host_kernel``, ``_fold_norm``: the native kernels (the step, the fold, the fold
  that takes torch's norm in its pass), checked against torch at first use.
* ``_common``: the lifecycle's values (``Phase`` and its table ``EDGES``,
  ``MicroStep``, ``Accumulation``) and what a failure leaves.
* ``_launcher``: each micro-step's execution, built, launched and ordered.
* ``_device_part``, ``_fraction``: ``offload_fraction < 1``: the device part (masters,
  state and sums in device memory, stepped by torch's kernel) and the lifecycle that
  joins it with the host part (``FractionLifecycle``).
* ``_lifecycle``: one owner for the accumulation and the step in flight
  (``Lifecycle``): every transition.
* ``_grads``, ``_placeholder``: what the loop's own calls on ``param.grad`` get
  (``LoopGrads``, over both parts' sums) and the placeholder itself (``HostGrad``).
* ``_edits``: the math of the loop's in-place edits, applied in the step.
* ``_model_sync``: ``param_groups`` followed, outside writes adopted (``ModelSync``).
* ``_intake``: the hooks and the wrapper policy (``GradientIntake``), calling down.
* ``_traces``: the last ended step's traces (``StepTraces``).
* ``_surface``: the masters, weights and checkpoints part of the surface (a mixin).
* ``_reports``: ``memory_stats()`` and ``host_step_path`` (a mixin).
* ``_checkpoint``: state dicts, as functions over the registry.
* ``_finder``: the model of an optimizer built from parameters.

See ``docs/concepts.md``, "How the code is laid out", for what each may touch.
``pipeoff/optim/full_offload.py`` is the thin orchestrator with the
``torch.optim.Optimizer`` surface.
"""

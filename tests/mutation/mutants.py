"""The mutants: one source edit per synchronization, and the tests that must catch it.

Each mutant removes (or weakens) one wait, fence, synchronize or dependency in
pipeoff's source. ``python -m tests.mutation.run`` applies it to a copy of the
tree and runs its ``tests`` there: they must fail. ``tests/mutation/test_mutants.py``
(in every CI run) checks that each ``old`` still occurs exactly once, so a
mutant cannot go stale in silence. See ``tests/mutation/README.md`` for the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTANTS", "Mutant"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Mutant:
    """One edit of one file that a test must catch."""

    name: str
    """Short id, unique; what ``run.py -k`` matches (``switch:NAME[@file]``, ``rNN:what``)."""
    file: str
    """The edited file, relative to the repository root."""
    old: str
    """Exact text that occurs exactly once in ``file``."""
    new: str
    """What replaces ``old``."""
    tests: tuple[str, ...]
    """pytest node ids or test files (relative to the root) that fail under the edit."""
    hazard: str
    """One line: what goes wrong on a GPU without the synchronization."""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"mutant name must be non-empty without spaces, got {self.name!r}")
        if not self.old or self.old == self.new:
            raise ValueError(f"mutant {self.name!r}: old must be non-empty and differ from new")
        if not isinstance(self.tests, tuple) or not self.tests:
            raise ValueError(f"mutant {self.name!r}: tests must be a non-empty tuple")
        if not self.hazard or "\n" in self.hazard:
            raise ValueError(f"mutant {self.name!r}: hazard must be one line")


def _switch(name: str, file: str, tests: tuple[str, ...], hazard: str, *,
            site: bool = False) -> Mutant:
    """The call site of mutation switch ``name`` in ``file``, edited to read as switched
    off (``_faults.disabled(name)`` is ``True``). ``site``: the switch has several call
    sites, and the mutant's name says which file this one is in."""
    label = f"switch:{name}@{file.rsplit('/', 1)[-1]}" if site else f"switch:{name}"
    return Mutant(name=label, file=file, old=f'_faults.disabled("{name}")', new="True",
                  tests=tests, hazard=hazard)


_CUDA = "pipeoff/executor/cuda.py"
_RUN = "pipeoff/executor/_run.py"
_SPEC_SRC = "pipeoff/ft/_outer_spec.py"
_TEST_CUDA = "tests/test_cuda.py"
_WAITS = "tests/test_cuda_waits.py"
_OPTIM_CUDA = "tests/optim/test_optim_cuda.py"
_FULL_CUDA = "tests/optim/test_full_offload_cuda.py"
_LOCAL_SGD_CUDA = "tests/ft/test_local_sgd_cuda.py"
_FRACTION = "tests/optim/test_offload_fraction.py"
_IL = "tests/optim/test_interrupted_loads.py"

# -- A. the mutation switches of pipeoff/_faults.py, one mutant per call site -------------
# The tests that use pipeoff.testing.disable(NAME) switch the mechanism off themselves
# and expect a failure: a source mutant must be caught by the positive runs (the same
# scenario with the mechanism on, asserting exact numbers or no race), listed here.
SWITCHES = (
    _switch("base_wait", _CUDA, (
        f"{_TEST_CUDA}::test_lanes_start_after_the_callers_stream",
        f"{_LOCAL_SGD_CUDA}::test_pipelined_matches_the_original_path_under_delays",
    ), "a lane's stream starts before the caller's stream has written its inputs "
       "(the backward's grads): the step reads partial gradients"),
    _switch("cross_lane_wait", _CUDA, (
        f"{_TEST_CUDA}::test_cross_lane_dependency_waits_on_a_delayed_lane",
        f"{_LOCAL_SGD_CUDA}::test_pipelined_matches_the_original_path_under_delays",
    ), "a task's stream runs before its dependency on another lane's stream has "
       "finished: it reads a half-copied tensor"),
    _switch("host_task_event", _CUDA, (
        f"{_TEST_CUDA}::test_device_tasks_wait_for_device_work_a_host_task_enqueued",
    ), "device tasks after a HOST task (should_commit loading a healed state) start "
       "before the device work that task enqueued has finished"),
    _switch("gate_wait", _CUDA, (
        "tests/test_gates.py::test_a_cuda_lane_waits_for_the_payloads_event",
        f"{_FULL_CUDA}::test_bitwise_equal_on_streams_with_slow_lanes",
    ), "a lane's stream reads a gate's payload (a gradient) before the producer's "
       "stream has written it", site=True),
    _switch("block_fence", _CUDA, (
        f"{_TEST_CUDA}::test_pooled_blocks_are_reused_only_after_their_last_user",
    ), "a lane reuses a pooled staging block while another execution's stream still "
       "reads or writes it: corrupted copies", site=True),
    _switch("host_sync", _CUDA, (
        f"{_TEST_CUDA}::test_a_host_task_reads_device_results_after_they_are_done",
        f"{_TEST_CUDA}::test_a_host_task_reads_device_work_a_host_task_before_it_on_"
        "its_lane_enqueued",
    ), "host work reads a device-to-host copy's destination (or decides on device "
       "results) before the copy has finished"),
    _switch("execution_sync", _CUDA, (
        f"{_TEST_CUDA}::test_wait_makes_host_reads_of_copies_safe",
    ), "Execution.wait() returns while device copies still run: host reads after it "
       "see old values"),
    _switch("gate_wait", _RUN, (
        "tests/test_gates.py::test_an_event_that_fails_to_synchronize_fails_the_"
        "execution_not_the_lane",
        f"{_WAITS}::test_a_host_task_blocks_on_its_gates_event",
        f"{_FULL_CUDA}::test_bitwise_equal_on_streams_with_slow_lanes",
    ), "a host lane reads a gate's payload before the device work writing it has "
       "finished", site=True),
    _switch("block_fence", _RUN, (
        f"{_TEST_CUDA}::test_an_inline_execution_waits_for_a_block_a_cuda_one_released",
    ), "a host-run task writes a pooled block that a CUDA execution released with its "
       "last copy still in flight", site=True),
    _switch("record_stream", "pipeoff/optim/_offload/_graph.py", (
        f"{_OPTIM_CUDA}::test_the_grad_a_lane_reads_is_fenced_for_the_allocator",
        f"{_OPTIM_CUDA}::test_bitwise_equal",
    ), "the caching allocator hands a dropped gradient's memory to new work while an "
       "overlap chunk's stream still reads it", site=True),
    _switch("record_stream", "pipeoff/optim/_full_offload/_lanes.py", (
        f"{_FULL_CUDA}::test_bitwise_equal_on_streams_with_slow_lanes",
    ), "the caching allocator hands a gradient's memory to new work while full "
       "offload's D2H stream still copies it out", site=True),
    _switch("record_stream", "pipeoff/optim/_full_offload/_one_pass.py", (
        f"{_FULL_CUDA}::test_one_pass_is_bitwise_on_streams_with_slow_lanes",
    ), "the caching allocator hands a final gradient's memory to new work while full "
       "offload's D2H stream still copies it into the held buffer", site=True),
    _switch("read_guard", "pipeoff/optim/_waits.py", (
        "tests/optim/test_patterns.py::test_every_read_waits_for_the_chunk_that_writes_it",
        "tests/optim/test_patterns.py::test_the_read_guard_teaches_the_hooks_an_early_read",
        "tests/optim/test_patterns.py::test_a_users_mode_around_the_step_keeps_the_read_"
        "guard",
    ), "an eager read of a parameter outside the hooked modules runs while an overlap "
       "chunk is still writing it: stale or torn weights"),
    _switch("hook_stream_wait", "pipeoff/optim/_waits.py", (
        f"{_OPTIM_CUDA}::test_forward_waits_make_streams_wait",
        f"{_OPTIM_CUDA}::test_fsdp_units_make_their_all_gather_streams_wait[simulated-None]",
        f"{_OPTIM_CUDA}::test_bitwise_equal",
    ), "the forward's stream reads parameters that an overlap chunk's stream is still "
       "writing"),
    _switch("fsdp_gather_wait", "pipeoff/optim/_hooks.py", (
        f"{_OPTIM_CUDA}::test_fsdp_units_make_their_all_gather_streams_wait[simulated-None]",
    ), "FSDP2's all-gather streams read shards that an optimizer chunk is still "
       "writing (they do not sync with compute after the root's pre-forward)"),
    _switch("accumulate_dep", "pipeoff/optim/_full_offload/_graph.py", (
        "tests/optim/test_full_offload.py::test_delayed_lanes_change_no_bit",
    ), "a step chunk steps on a gradient sum whose last accumulation is still being "
       "written"),
    _switch("micro_step_order", "pipeoff/optim/_full_offload/_launcher.py", (
        "tests/optim/test_full_offload.py::test_micro_steps_that_do_not_wait_for_each_"
        "other_are_wrong[False]",
    ), "a micro-step's accumulation races the previous micro-step's and its step: "
       "gradients added out of order or lost"),
    _switch("held_copy_dep", "pipeoff/optim/_full_offload/_graph.py", (
        "tests/optim/test_full_offload_one_pass.py::test_a_held_gradient_is_stepped_only_"
        "after_its_copy_landed[False]",
        f"{_FULL_CUDA}::test_a_held_gradient_read_before_its_copy_landed_is_a_race",
    ), "a one-pass step chunk folds a held gradient inside its pass before its copy into "
       "the held buffer has landed: it steps on the last step's gradient"),
    _switch("held_release", "pipeoff/optim/_full_offload/_one_pass.py", (
        "tests/optim/test_full_offload_one_pass.py::test_a_final_backward_copies_into_the_"
        "held_buffer_after_the_step_that_read_it[False]",
        f"{_FULL_CUDA}::test_a_held_gradient_overwritten_before_its_step_read_it_is_a_race",
    ), "a final backward's copies overwrite held gradients that the step in flight has not "
       "folded yet: that step steps on the next step's gradients"),
    _switch("ddp_reduced", "pipeoff/optim/_full_offload/_lifecycle.py", (
        "tests/optim/test_full_offload_ranks.py::test_under_ddp_the_reduced_gradient_is_"
        "stepped",
    ), "full offload takes param.grad before DDP's reducer wrote the averaged "
       "gradient: each rank steps its own and the replicas diverge"),
    _switch("adopt_waits_readers", "pipeoff/optim/_full_offload/_model_sync.py", (
        "tests/optim/test_full_offload_loops.py::test_a_transfer_delivers_the_step_it_was_"
        "launched_after",
    ), "weights written from outside are adopted as masters while a transfer still "
       "reads the old ones: it delivers a torn mix"),
    _switch("diloco_formed_wait", "pipeoff/ft/_diloco_fragment.py", (
        "tests/ft/test_diloco_cuda.py::test_the_held_formation_is_clean_with_its_wait",
        "tests/ft/test_diloco_cuda.py::test_offloaded_modes_match_torchft_under_delays",
        "tests/ft/test_diloco.py::test_a_removed_formed_wait_changes_the_result",
        "tests/ft/test_diloco.py::"
        "test_without_the_formation_wait_a_weight_clip_corrupts_the_sync",
    ), "with fragment_sync_delay > 0 the next inner step writes parameters that the "
       "sync's pseudo-gradient tasks have not read yet: a wrong pseudo-gradient"),
    _switch("diloco_abandon_forms", "pipeoff/ft/_diloco_fragment.py", (
        "tests/ft/test_peer_failed.py::test_a_replica_that_leaves_before_its_pseudo_"
        "gradients_are_formed_gives_them_all",
    ), "a replica whose DiLoCo context exits before its sync formed the pseudo-gradients "
       "joins the all-reduces with zeros: its peer commits another average than torchft's"),
    _switch("grad_read_wait", "pipeoff/optim/_full_offload/_grads.py", (
        "tests/optim/test_full_offload_clip.py::test_a_clip_call_waits_for_the_host_folds",
    ), "the loop's clip call reads a host gradient sum whose last fold has not "
       "written it: a norm (and a clip coefficient) of part of the gradient"),
    _switch("grad_edit_wait", "pipeoff/optim/_full_offload/_lifecycle.py", (
        "tests/optim/test_full_offload_clip.py::"
        "test_a_gradient_set_by_hand_waits_for_the_folds_it_replaces",
    ), "a gradient set by hand replaces a host sum that a fold still writes: the fold "
       "lands on the replacement"),
    _switch("diloco_formation_guard", "pipeoff/ft/_diloco_fragment.py", (
        "tests/ft/test_diloco.py::test_a_weight_clip_after_the_preparing_step_waits_for_the_"
        "formation",
    ), "with fragment_sync_delay > 0 a weight clip after the preparing step() writes "
       "parameters that the pseudo-gradient tasks, running under the next forward, have "
       "not read yet: a wrong pseudo-gradient"),
    _switch("diloco_forward_wait", "pipeoff/ft/_diloco_tail.py", (
        "tests/ft/test_diloco_tail.py::test_the_next_forward_waits_for_the_merge",
        "tests/ft/test_diloco_cuda.py::test_the_next_forward_waits_for_the_held_writes_on_"
        "streams",
    ), "the next forward reads parameters that a DiLoCo sync's merge, running on after "
       "its decision, has not written yet"),
    _switch("device_part_wait", "pipeoff/optim/_offload/_device_part.py", (
        f"{_FRACTION}::test_a_reader_off_the_callers_stream_waits_for_the_device_part"
        "[simulated-False]",
    ), "a reader off the caller's stream (another stream or thread, the host after "
       "wait_for_step() or a chunked step) reads device-part parameters or state that "
       "torch's kernel on the caller's stream has not written yet"),
    _switch("host_part_join", "pipeoff/optim/_offload/_join.py", (
        f"{_FRACTION}::test_a_device_part_failure_is_reported_after_the_host_part[False]",
    ), "a device part that raised is reported (retryable, or torn) while the host part's "
       "chunks still write: a retry steps them twice, or a loaded checkpoint is "
       "overwritten"),
    _switch("inner_post_hook_wait", "pipeoff/optim/_offloaded.py", (
        "tests/optim/test_optimizer_hooks.py::test_the_wrapped_optimizers_post_hooks_run_"
        "after_an_overlapped_step",
    ), "a step post hook on the wrapped optimizer reads its state while the overlapped "
       "step's chunks still write it (stale), or writes it (the edit overwritten)"),
    _switch("outer_state_waits", "pipeoff/ft/_diloco.py", (
        "tests/ft/test_diloco_speculative.py::test_the_outer_state_edited_right_after_step_"
        "is_the_stepped_one",
    ), "the loop reads or edits the outer state right after step() while the sync's outer "
       "step still writes it: the edit is lost or stepped over, the read torn"),
    _switch("diloco_tail_wait", "pipeoff/ft/_diloco_tail.py", (
        "tests/ft/test_diloco_tail.py::test_the_inner_step_waits_for_the_merge",
    ), "the inner step after a DiLoCo sync writes parameters that the sync's merge then "
       "overwrites (or lerps with the stepped values)"),
    _switch("full_device_part_wait", "pipeoff/optim/_full_offload/_device_part.py", (
        "tests/optim/test_full_offload_fraction_cuda.py::"
        "test_a_reader_off_the_callers_stream_waits_for_the_device_part[simulated-False]",
    ), "a reader off the caller's stream (another stream or thread, the host after "
       "wait_for_step() or a synchronous step) reads full offload's device-part weights, "
       "masters or state that torch's kernel on the caller's stream has not written yet"),
    _switch("full_host_part_join", "pipeoff/optim/_full_offload/_fraction.py", (
        "tests/optim/test_full_offload_fraction.py::"
        "test_a_device_part_failure_is_reported_after_the_host_part[False]",
    ), "a full-offload device part that raised is reported (dirty: zero_grad() and go "
       "on) while the host part's chunks still write: a step half applied goes unnoticed"),
)

# -- B. review findings: edits that the switches do not cover ----------------------------
REVIEW = (
    Mutant(
        name="r01:dispatched-after-finish", file=_CUDA,
        old=("        state.dispatched[i] = True\n"
             "        run.release(i, ready=state.ends[i])\n"
             "        run.finish(i, outcome[0])\n"),
        new=("        run.release(i, ready=state.ends[i])\n"
             "        run.finish(i, outcome[0])\n"
             "        state.dispatched[i] = True\n"),
        tests=(f"{_WAITS}::test_a_dependency_seen_finished_is_seen_issued",),
        hazard="a dependent woken by finish() sees dispatched False and skips its "
               "wait_event on the task's end event: it runs before the task on the GPU"),
    Mutant(
        name="r02:cancel-without-ready-events", file=_CUDA,
        old="run.cancel(i, ready_of=functools.partial(self._last_ready, run, state, before=i))",
        new="run.cancel(i)",
        tests=(f"{_WAITS}::test_a_cancelled_last_user_releases_its_block_after_the_issued_ones",),
        hazard="a cancelled task's blocks go back to the pool without the last issued "
               "user's end event: reused while that user's stream still runs"),
    Mutant(
        name="r03:no-same-lane-host-dep-wait", file=_CUDA,
        old=("            waits += tuple(j for j in (index[d] for d in task.deps)\n"
             "                           if lanes[j] == lanes[i] and run.tasks[j].kind is "
             "TaskKind.HOST)\n"),
        new="            pass\n",
        tests=(f"{_TEST_CUDA}::test_a_host_task_reads_device_work_a_host_task_before_it_on_"
               "its_lane_enqueued",),
        hazard="a HOST task reads results of device work that a HOST dependency on its "
               "lane enqueued, before that work has finished"),
    Mutant(
        name="r04:synchronize-ignores-host-recorded", file=_CUDA,
        old="        if state is None or not (state.dispatched[i] or state.host_recorded[i]):\n"
            "            return True\n",
        new="        if state is None or not state.dispatched[i]:\n"
            "            return True\n",
        tests=(f"{_WAITS}::test_waiting_for_a_host_task_waits_for_the_device_work_it_enqueued",),
        hazard="Execution.wait() and a HOST task's Completion.synchronize() return before "
               "the device work that task enqueued has finished"),
    Mutant(
        name="r05:finalize-without-synchronize", file=_CUDA,
        old="        self.synchronize_all(run, None)\n",
        new="",
        tests=(f"{_WAITS}::test_a_failed_execution_is_finalized_after_its_device_work",),
        hazard="finalize recycles events and forgets blocks' ready markers while device "
               "work is pending: later runs reuse blocks still in use"),
    Mutant(
        name="r06:host-gate-wait-is-a-stream-wait", file=_RUN,
        old="ev.synchronize()",
        new="ev.wait()",
        tests=(f"{_WAITS}::test_a_host_task_blocks_on_its_gates_event",),
        hazard="a host lane waits on a gate's event with a stream wait, which does not "
               "block the host: it reads the payload before it is written"),
    Mutant(
        name="r07:host-block-fence-is-a-stream-wait", file=_RUN,
        old="block.ready.synchronize()",
        new="block.ready.wait()",
        tests=(f"{_WAITS}::test_a_host_task_fences_a_pinned_block_a_cuda_execution_released",),
        hazard="a host task touches a pooled block after only a stream wait on its "
               "previous user: the host writes while that copy still runs"),
    Mutant(
        name="r08:inline-without-synchronize", file="pipeoff/executor/inline.py",
        old="                stream.synchronize()\n",
        new="                pass\n",
        tests=(f"{_WAITS}::test_an_inline_execution_finishes_each_task_on_the_device_before_the_next",),
        hazard="a synchronous schedule starts task i+1, and returns staging, while task "
               "i's device work still runs"),
    Mutant(
        name="r09:task-wait-only-waits-for-issue", file="pipeoff/execution.py",
        old="ok = self._backend.synchronize(run, i, deadline)",
        new="ok = run.wait_terminal(i, deadline)",
        tests=(f"{_WAITS}::test_waiting_for_a_device_task_synchronizes_the_host",),
        hazard="Execution.wait('task') returns once the task is issued, not once its "
               "device work has finished: host reads after it are early"),
    Mutant(
        name="r10:gate-event-published-after-state", file="pipeoff/executor/_gates.py",
        old=("            self.event[k] = event\n"
             "            self.opened_ns[k] = time.perf_counter_ns() - self._origin_ns\n"
             "            self._cond.notify_all()\n"),
        new=("            self.opened_ns[k] = time.perf_counter_ns() - self._origin_ns\n"
             "            self._cond.notify_all()\n"
             "        self.event[k] = event\n"),
        tests=(f"{_WAITS}::test_a_gate_is_seen_open_only_with_its_event",),
        hazard="a lane woken by the gate's open reads its event as None and skips the "
               "wait on the payload's producer"),
    Mutant(
        name="r11:launch-without-its-stream", file="pipeoff/_accel.py",
        old="        with self.runtime.stream(stream):\n            fn()\n",
        new="        fn()\n",
        tests=(f"{_TEST_CUDA}::test_cross_lane_dependency_waits_on_a_delayed_lane",),
        hazard="Cuda.launch runs a task's work without its lane's stream current: its "
               "kernels go to another stream, outside the waits made on the lane's"),
    Mutant(
        name="r12:record-stream-does-nothing", file="pipeoff/_accel.py",
        old="        self.runtime.record_stream(t, stream)\n",
        new="        pass\n",
        tests=(f"{_OPTIM_CUDA}::test_the_grad_a_lane_reads_is_fenced_for_the_allocator",),
        hazard="the caching allocator hands a gradient a lane still reads to the next "
               "allocation on the compute stream"),
    Mutant(
        name="r13:synchronize-only-the-current-stream", file="pipeoff/_accel.py",
        old="        self.runtime.synchronize(device)\n",
        new="        self.runtime.current_stream(device).synchronize()\n",
        tests=(f"{_WAITS}::test_synchronize_waits_for_every_stream_of_the_device",),
        hazard="Cuda.synchronize returns while lanes' streams still run: the host reads "
               "their results early"),
    Mutant(
        name="r14:fsdp-wait-without-compute-stream", file="pipeoff/optim/_hooks.py",
        old="streams = (_accel.current().current_stream(waits.device), *gathers)",
        new="streams = (*gathers,)",
        tests=(f"{_OPTIM_CUDA}::test_a_one_rank_fsdp_unit_copies_its_shards_on_the_compute_stream",),
        hazard="an FSDP2 unit's compute stream does not wait for the chunk: the forward "
               "reads parameters still being written"),
    Mutant(
        name="r15:zero-grad-in-place-without-wait", file="pipeoff/optim/offload.py",
        old="            self.wait_for_step()  # the chunks still read these grads\n",
        new="            pass\n",
        tests=(f"{_OPTIM_CUDA}::test_zero_grad_in_place_waits_for_the_chunks_that_read_the_grads",),
        hazard="zero_grad(set_to_none=False) zeroes grads that the step's chunks still "
               "read: the step uses zeros"),
    Mutant(
        name="r16:step-without-norm-allreduce-settle", file="pipeoff/optim/full_offload.py",
        old='                settle(acc.execution, NORM_ALLREDUCE, timeout=self.timeout)\n',
        new="                pass\n",
        tests=("tests/optim/test_full_offload.py::test_step_returns_after_the_clipping_norms_all_reduce",),
        hazard="step() returns with the clipping norm's all-reduce in flight: the next "
               "forward's collectives go on the same process group from two threads"),
    Mutant(
        name="r17:local-copy-without-preflight", file="pipeoff/transfer/_graph.py",
        old='dst_where[u.key]), None, ["preflight"],',
        new="dst_where[u.key]), None, [],",
        tests=("tests/transfer/test_transfer.py::test_a_slow_preflight_that_refuses_leaves_the_target_unwritten",),
        hazard="local copies start before the preflight has waited for the caller's "
               "stream and every rank agreed: they read sources still being written"),
    Mutant(
        name="r18:failed-allreduce-keeps-buffer", file="pipeoff/ft/_collective.py",
        old="        # later ones are still joined, as torchft issues them all before waiting.)\n"
            "        ctx.retire_buffer(dev)\n",
        new="        # later ones are still joined, as torchft issues them all before waiting.)\n"
            "        pass\n",
        tests=(f"{_LOCAL_SGD_CUDA}::test_a_block_a_failed_all_reduce_may_still_write_is_never_reused",),
        hazard="after a failed all-reduce the staging block goes back to the pool while "
               "the collective may still write it: another bucket's data is overwritten"),
    Mutant(
        name="r40:task-wait-acquires-the-runs-clock", file=_RUN,
        old=("        _happens.acquire(self, i)  # what the task's thread did comes before "
             "what we do\n"),
        new="        _happens.acquire(self, None)\n",
        tests=("tests/test_simcuda.py::test_waiting_for_a_task_orders_after_that_task_only",),
        hazard="a task's waiter is ordered after every task the run has finished, not after "
               "that one: the simulated device's checker misses real host-to-host races"),
    Mutant(
        name="r41:native-region-wakeup-unguarded", file="pipeoff/_native/hoststep.c",
        old=("            pthread_mutex_lock(&r->lock);\n"
             "            pthread_cond_broadcast(&r->all_done);\n"
             "            pthread_mutex_unlock(&r->lock);\n"),
        new="            pthread_cond_broadcast(&r->all_done);\n",
        tests=("tests/optim/test_host_kernel.py::test_the_last_chunks_wake_up_reaches_a_"
               "caller_about_to_wait",),
        hazard="the last chunk's broadcast lands between the caller's done < chunks check "
               "and its pthread_cond_wait: lost, the kernel call (a lane's step) never "
               "returns"),
    Mutant(
        name="r42:native-region-wakeup-before-the-lock", file="pipeoff/_native/hoststep.c",
        old=("            pthread_mutex_lock(&r->lock);\n"
             "            pthread_cond_broadcast(&r->all_done);\n"),
        new=("            pthread_cond_broadcast(&r->all_done);\n"
             "            pthread_mutex_lock(&r->lock);\n"),
        tests=("tests/optim/test_host_kernel.py::test_the_last_chunks_wake_up_reaches_a_"
               "caller_about_to_wait",),
        hazard="the last chunk's broadcast made before taking the region's mutex: lost "
               "between the caller's check and its wait, the kernel call never returns"),
    Mutant(
        name="r43:norm-allreduce-let-go-at-launch",
        file="pipeoff/optim/_full_offload/_launcher.py",
        old="        ex = execute(graph, schedule)\n        prev = self.prev\n",
        new=("        ex = execute(graph, schedule)\n"
             "        if REDUCE in graph.gates:\n"
             "            ex.gate(REDUCE).open(None)\n"
             "        prev = self.prev\n"),
        tests=("tests/optim/test_full_offload_ranks.py::test_the_norms_all_reduce_waits_for_"
               "the_callers_collectives_before_step",),
        hazard="the lane's clipping-norm all-reduce runs as soon as a marked final backward's "
               "norm is ready, beside the caller's own collectives on the same group: ranks "
               "pair them in different orders (wrong sums, or a hang)"),
    Mutant(
        name="r44:torn-check-without-master-versions",
        file="pipeoff/optim/_full_offload/_lanes.py",
        old=("            if (any(m._version != v for m, v in zip(masters, versions))\n"
             "                    or any(g.advanced for g in groups.values())):\n"),
        new="            if any(g.advanced for g in groups.values()):\n",
        tests=("tests/optim/test_full_offload.py::test_a_chunk_that_fails_after_writing_"
               "masters_is_never_taken_for_clean",
               "tests/optim/test_host_kernel.py::test_a_chunk_that_fails_part_way_is_torn_"
               "when_it_wrote"),
        hazard="a step chunk that raises after writing some masters (torch's for-loop step, "
               "the native kernel) is taken for one that wrote nothing: zero_grad() and "
               "training go on from half-stepped masters"),
    Mutant(
        name="r45:h2d-overwrite-unchecked", file="pipeoff/optim/_full_offload/_lanes.py",
        old="            if version_of(rec.param) != rec.version:\n",
        new="            if False:\n",
        tests=("tests/optim/test_full_offload_loops.py::test_a_weight_written_after_a_final_"
               "backward_under_backward_overlap_is_refused",),
        hazard="a weight written from outside after the final backward began is silently "
               "overwritten by the step's H2D copy: the write is lost, step() does not "
               "refuse"),
    Mutant(
        name="r20:diloco-unformed-bucket-joins-as-is", file="pipeoff/ft/_diloco_work.py",
        old="                    flat.zero_()\n",
        new="                    pass\n",
        tests=("tests/ft/test_diloco.py::test_a_replica_that_fails_alone_contributes_a_zero_"
               "pseudo_gradient",),
        hazard="a replica whose pseudo-gradient task failed joins the all-reduce with what its "
               "staging held: its healthy peer commits an average with garbage in it"),
    Mutant(
        name="r19:native-region-returns-early", file="pipeoff/_native/hoststep.c",
        old="    while (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE) < r->chunks)\n",
        new="    while (0)\n",
        tests=("tests/optim/test_host_kernel.py::test_the_region_returns_after_its_last_chunk",
               "tests/optim/test_host_kernel.py::test_a_call_returns_only_when_every_chunk_is_done"),
        hazard="a native kernel returns while helper threads still write its chunks: the "
               "H2D copy (or the next step) reads half-stepped masters"),
    Mutant(
        name="r21:main-thread-wait-unsliced", file="pipeoff/executor/_run.py",
        old="    if threading.current_thread() is not threading.main_thread():\n",
        new="    if True:\n",
        tests=("tests/test_wait_slices.py",),
        hazard="a main-thread wait blocks in one piece: a Ctrl-C that lands just before it "
               "blocks is raised only when the wait ends (never, on a hung collective)"),
    Mutant(
        name="r22:deadline-wait-unsliced", file="pipeoff/executor/_run.py",
        old="""        left = SIGNAL_CHECK_S if deadline is None else min(
            SIGNAL_CHECK_S, deadline - time.monotonic())\n""",
        new="        left = SIGNAL_CHECK_S if deadline is None else deadline - time.monotonic()\n",
        tests=("tests/test_wait_slices.py",),
        hazard="a main-thread wait with a deadline blocks until it: a Ctrl-C that lands just "
               "before it blocks waits for the timeout (a step's timeout, minutes)"),
    Mutant(
        name="r23:native-step-unannounced", file="pipeoff/optim/_full_offload/_host_kernel.py",
        old='        if announce:\n            _happens.native_access("pipeoff_adam_step"',
        new='        if False:\n            _happens.native_access("pipeoff_adam_step"',
        tests=("tests/test_simcuda.py::test_a_native_step_reading_a_pending_copy_is_a_race",),
        hazard="the native step's raw-pointer reads are invisible to the checker: a step "
               "reading a gradient whose D2H copy is pending goes unreported"),
    Mutant(
        name="r24:hand-over-without-readers-wait",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="this gate) still reads them.\n            self.readers.wait()\n",
        new="this gate) still reads them.\n            pass\n",
        tests=("tests/optim/test_full_offload.py::test_a_transfer_between_the_final_backward_"
               "and_step_reads_the_masters_before_it",),
        hazard="step() opens the chunks' gate while a transfer launched after the marked final "
               "backward still reads the masters: it copies half-stepped masters"),
    Mutant(
        name="r25:step-stats-without-wait", file="pipeoff/optim/_offloaded.py",
        old=("            return None\n        self.wait_for_step()\n"
             "        trace = self.last_trace"),
        new="            return None\n        pass\n        trace = self.last_trace",
        tests=("tests/optim/test_full_offload.py::test_last_step_stats_waits_for_the_step_it_"
               "describes",),
        hazard="last_step_stats read while the step is in flight describes the step before "
               "with this step's number: a logger records wrong figures"),
    Mutant(
        name="r26:diloco-formed-marked-before-the-work", file="pipeoff/ft/_diloco_work.py",
        old="""            flat = ctx.buffer(dev, b.dtype)
            for pc in b.pieces:
                part = flat[pc.offset:pc.offset + pc.numel]""",
        new="""            flat = ctx.buffer(dev, b.dtype)
            if not self.form_first:
                self.results.formed.add(k)
            for pc in b.pieces:
                part = flat[pc.offset:pc.offset + pc.numel]""",
        tests=("tests/ft/test_diloco.py::test_a_replica_that_fails_alone_contributes_a_zero_"
               "pseudo_gradient",),
        hazard="a bucket whose formation failed half-way joins the all-reduce as formed: its "
               "healthy peer commits an average with the staged backup in it"),
    Mutant(
        name="r27:diloco-failure-after-commit-unreported", file="pipeoff/ft/_diloco_fragment.py",
        old="                # should_commit() is False, and raise.\n"
            "                manager.report_error(err)\n",
        new="                # should_commit() is False, and raise.\n                pass\n",
        tests=("tests/ft/test_diloco.py::test_a_failed_outer_step_after_commit_raises_with_a_"
               "note[synchronous]",),
        hazard="a replica half-written after its commit is not reported to torchft: its next "
               "should_commit() is True and no peer ever heals it"),
    Mutant(
        name="r28:native-arguments-reordered", file="pipeoff/_native/hoststep.c",
        old="int64_t n, int adam_wd, float wd, float decay, float sign, float scale,",
        new="int64_t n, int adam_wd, float decay, float wd, float sign, float scale,",
        tests=("tests/test_native_signatures.py::test_the_bound_signatures_are_the_c_"
               "definitions",),
        hazard="two same-type arguments of a native kernel swapped in C but not in the ctypes "
               "table: every AdamW step with weight decay silently computes the wrong update"),
    Mutant(
        name="r29:norm-allreduce-skipped-without-gradients",
        file="pipeoff/optim/_full_offload/_lanes.py",
        old="    for key in keys:\n",
        new="    for key in [k for k in keys if k in partial]:\n",
        tests=("tests/optim/test_full_offload_ranks.py::test_a_rank_without_gradients_of_a_"
               "group_still_joins_its_norm_all_reduce",),
        hazard="a rank holding no gradient of a set of groups (an expert no token reached) "
               "skips their norm all-reduce: its peers pair the wrong collectives or wait, "
               "and it clips by its own norm"),
    Mutant(
        name="r50:diloco-checkpoint-reads-a-running-outer-step",
        file="pipeoff/ft/_diloco_tail.py",
        old="            # outer state that the outer step is still writing.\n"
            "            ex.wait()\n",
        new="            # outer state that the outer step is still writing.\n"
            "            pass\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_checkpoint_on_another_thread_waits_"
               "for_the_outer_step",),
        hazard="torchft's checkpoint function (a healing peer's source, on the quorum "
               "thread) sends a backup the outer step is still writing: a torn model"),
    Mutant(
        name="r51:diloco-tail-failure-unreported", file="pipeoff/ft/_diloco_tail.py",
        old="                self.manager.report_error(failure)\n",
        new="                pass\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_failed_write_reaches_the_next_forward_"
               "once_and_is_reported",),
        hazard="a sync whose write failed under the next forward leaves the replica "
               "half-written, and torchft, not told, never heals it"),
    Mutant(
        name="r57:diloco-stop-leaves-the-failed-sync-running",
        file="pipeoff/ft/_diloco_fragment.py",
        old="        try:\n            ex.wait()\n        except Exception:  "
            "# noqa: BLE001 - the same failure, kept above\n",
        new="        try:\n            pass\n        except Exception:  "
            "# noqa: BLE001 - the same failure, kept above\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_failed_sync_stops_only_once_its_started_"
               "tasks_have_finished",),
        hazard="a failed sync's started tasks still run when perform_sync restores the "
               "parameters and returns: they outlive the sync, its staging and its trace"),
    Mutant(
        name="r58:norm-sum-left-in-device-memory", file="pipeoff/optim/_full_offload/_lanes.py",
        old="            sq = _dist.all_reduce_host(sq, group, devices[key])",
        new="            _dist.all_reduce_host(sq, group, devices[key])",
        tests=("tests/optim/test_full_offload_ranks.py::test_a_rank_without_gradients_of_a_"
               "group_still_joins_its_norm_all_reduce[device]",),
        hazard="over an NCCL-only group the clipping norm's sum stays on the device copy: "
               "each rank clips by its own shard's norm"),
    Mutant(
        name="r52:diloco-outer-state-dict-before-the-outer-step", file="pipeoff/ft/_diloco.py",
        old="            # first step creates (shown once it is done).\n"
            "            tail.wait_done()\n",
        new="            # first step creates (shown once it is done).\n"
            "            pass\n",
        tests=("tests/ft/test_diloco_tail.py::test_the_users_outer_optimizer_state_dict_"
               "waits_for_the_outer_step",),
        hazard="a checkpoint of the user's outer optimizer taken right after a sync saves "
               "state the outer step has not written (or not yet created)"),
    Mutant(
        name="r61:grad-edit-waits-for-an-unopened-norm-all-reduce",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="                ms.execution.wait(NORM, timeout=self.config.timeout)\n",
        new="                acc.wait_norm(self.config.timeout)\n",
        tests=("tests/optim/test_full_offload_fsdp2.py::test_a_device_part_under_fsdp2_is_"
               "bitwise_the_reference",),
        hazard="under FSDP2 a gradient set or dropped by the loop after the micro-steps "
               "waits for the norm's all-reduce, whose gate only the caller opens: a hang"),
    Mutant(
        name="r60:device-only-final-backward-unseen",
        file="pipeoff/optim/_full_offload/_fraction.py",
        old="                    or self.config.overlap == \"backward\"):\n",
        new="                    or False):\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_overlap_backward_sums_are_"
               "read_and_edits_refused_after_a_device_only_backward",),
        hazard="a final backward whose gradients are all the device part's is not seen as "
               "final: an lr edit before step() is taken silently, the sums' reads refused"),
)

_SPEC = "tests/ft/test_diloco_speculative.py::"
SPECULATIVE = (
    Mutant(
        name="r54:writes-before-the-spares-are-kept", file="pipeoff/ft/_diloco_graph.py",
        old='        deps = (["keep"] if speculative else',
        new='        deps = ([] if speculative else',
        tests=(f"{_SPEC}test_the_writes_wait_for_the_spares_to_be_kept",),
        hazard="the merges read the backups before the commit swapped the stepped spares "
               "in: the parameters merge with the old global model"),
    Mutant(
        name="r55:speculative-step-kept-after-an-lr-edit", file="pipeoff/ft/_diloco_fragment.py",
        old="self._spec_stale or self.outer.user_changed()\n",
        new="self._spec_stale or False\n",
        tests=(f"{_SPEC}test_an_lr_edited_before_the_decision_is_the_one_stepped",),
        hazard="an outer lr edited between a sync's preparation and its decision (a "
               "schedule) is not the one stepped: torchft steps with the decision's"),
    Mutant(
        name="r56:speculative-step-kept-after-a-healing-load",
        file="pipeoff/ft/_diloco_fragment.py",
        old="                self._spec_stale = True\n",
        new="                pass\n",
        tests=(f"{_SPEC}test_a_healing_load_before_the_decision_takes_the_step_again",),
        hazard="a healing load of the backups and outer state before the decision is "
               "stepped over by a step taken from the old ones"),
    Mutant(
        name="r62:speculative-step-kept-after-an-in-place-state-edit",
        file="pipeoff/ft/_diloco_fragment.py",
        old="                        or spec.state_edited()):",
        new="                        or False):",
        tests=(f"{_SPEC}test_state_edited_in_place_before_the_decision_is_the_state_stepped",),
        hazard="the outer state edited in place before the decision (a momentum decay) is "
               "lost: the kept spares hold the state copied before the edit"),
    Mutant(
        name="r63:sync-on-masters-before-adopting-a-heal", file="pipeoff/ft/_diloco.py",
        old="            opt.adopt_outside_writes()\n        return chosen",
        new="            pass\n        return chosen",
        tests=("tests/ft/test_diloco_masters.py::test_a_healed_replica_syncs_from_the_"
               "healed_weights",),
        hazard="a healed replica forms pseudo-gradients from its stale FP32 masters and "
               "averages its pre-heal model into every replica"),
    Mutant(
        name="r64:checkpoint-before-adopting-the-loops-writes",
        file="pipeoff/optim/_full_offload/_surface.py",
        old="        self.adopt_outside_writes()\n        return _checkpoint.pack(",
        new="        return _checkpoint.pack(",
        tests=("tests/optim/test_full_offload.py::test_a_checkpoint_after_the_loop_wrote_"
               "the_weights_holds_the_write",),
        hazard="a checkpoint taken after the loop wrote weights holds the old masters: the "
               "resume drops the write"),
    Mutant(
        name="r65:outer-state-removed-by-the-loop-kept", file="pipeoff/ft/_outer.py",
        old="            del host_state[h]\n",
        new="            pass\n",
        tests=("tests/ft/test_diloco_outer_state.py::test_a_reset_in_the_synchronous_"
               "schedule_is_torchfts",),
        hazard="a reset of the outer state (state.clear(), a load without it) is ignored: "
               "the host optimizer steps on with the old momentum"),
    Mutant(
        name="r66:speculative-step-kept-after-a-state-reset", file="pipeoff/ft/_outer.py",
        old="                   for p, h in self._pairs()) or bool(self._removed())\n",
        new="                   for p, h in self._pairs())\n",
        tests=("tests/ft/test_diloco_outer_state.py::test_a_reset_before_the_decision_is_"
               "not_stepped_over",),
        hazard="a reset of the outer state before a delayed sync's decision is lost: the "
               "kept spares hold the step from the old momentum"),
    Mutant(
        name="r67:must-run-task-cancelled-when-its-staging-fails", file=_RUN,
        old="                if not task.must_run:\n                    self.cancel(i)\n"
            "                    return\n                # A must_run task",
        new="                if True:\n                    self.cancel(i)\n"
            "                    return\n                # A must_run task",
        tests=("tests/test_executor.py::test_a_must_run_task_runs_after_its_own_failure_"
               "to_start",),
        hazard="an out-of-memory allocating a transfer round's wire buffer cancels that "
               "rank's exchange: its peers wait in the collective until the timeout"),
    Mutant(
        name="r68:must-run-task-skipped-when-its-start-fails", file=_RUN,
        old="                        if not task.must_run:\n                            raise\n",
        new="                        raise\n",
        tests=("tests/test_executor.py::test_a_must_run_task_runs_after_its_own_failure_"
               "to_start",),
        hazard="a failure starting a collective task (a Ctrl-C in an injected delay) skips "
               "its work: the peers wait in the collective until the timeout"),
    Mutant(
        name="r69:ctrl-c-between-a-rounds-collectives", file="pipeoff/_held_interrupt.py",
        old="        signal.signal(signal.SIGINT, caught)\n",
        new="        pass\n",
        tests=("tests/transfer/test_transfer.py::test_ctrl_c_between_a_rounds_collectives_"
               "comes_after_them",
               "tests/optim/test_interrupts.py::test_a_ctrl_c_inside_the_device_part_is_"
               "passed_on_after_it[full-none]"),
        hazard="a Ctrl-C between a transfer round's fault flag and its all-to-all (the "
               "synchronous schedule) leaves the peers waiting until the group's timeout; "
               "one inside an optimizer's device part tears the step"),
    Mutant(
        name="r70:exchange-failing-before-its-flag", file="pipeoff/transfer/_transfer.py",
        old="                except BaseException as err:  # noqa: BLE001 - raised once the "
            "peers know\n",
        new="                except ZeroDivisionError as err:\n",
        tests=("tests/transfer/test_transfer_two_ranks.py::test_a_rank_failing_before_it_"
               "joined_a_round_tears_the_transfer_on_both",),
        hazard="an exchange that fails before its fault flag never joins the round: its "
               "peers wait in the collective until the group's timeout"),
    Mutant(
        name="r71:spares-kept-by-a-swap-under-a-view", file=_SPEC_SRC,
        old="                    real[k].copy_(v)\n",
        new="                    _swap(real[k], v)\n",
        tests=("tests/ft/test_diloco_outer_state.py::test_a_view_of_the_outer_state_sees_"
               "the_state_after_a_speculative_sync",),
        hazard="a view of the outer state taken by the loop is left on the old storage by "
               "a speculative sync: an edit through it is lost"),
    Mutant(
        name="r72:replaced-outer-state-undone-by-the-first-step", file="pipeoff/ft/_outer.py",
        old="        replaced = not adopted and user_state is not self._state_obj\n",
        new="        replaced = False\n",
        tests=("tests/ft/test_diloco_outer_state.py::test_a_reset_right_after_the_syncing_"
               "step_is_torchfts",),
        hazard="outer.state replaced right after the first sync's step() is refilled with "
               "the state that step created under the next forward"),
    Mutant(
        name="r73:ranks-fractions-not-compared", file="pipeoff/optim/_full_offload/_auto.py",
        old="    if high == low:\n        return\n",
        new="    if True:\n        return\n",
        tests=("tests/optim/test_full_offload_fsdp2.py::test_fractions_that_differ_between_"
               "ranks_are_refused_on_every_rank",),
        hazard="FSDP2 ranks given different offload fractions split differently and hang in "
               "the norm's collectives at the first clipped step"),
    Mutant(
        name="r74:reshaped-outer-state-stepped", file="pipeoff/ft/_outer_kernel.py",
        old="            and all(_fp32_1d(t, n) and t.shape == param.shape for t in held)\n",
        new="            and all(_fp32_1d(t, n) for t in held)\n",
        tests=("tests/ft/test_diloco_outer_state.py::test_a_reshaped_outer_state_raises_as_"
               "torchfts",),
        hazard="a state tensor the loop reshaped is stepped by the native kernel where "
               "torch's step raises: the loop's mistake goes on silently"),
    Mutant(
        name="r75:failed-peer-not-told", file="pipeoff/ft/_collective.py",
        old="    if failed or joined is None:\n",
        new="    if True:\n",
        tests=("tests/ft/test_peer_failed.py",),
        hazard="a healthy replica commits an average holding the values of a peer that "
               "failed the sync before its first all-reduce (torchft's peers reject)"),
    Mutant(
        name="r76:healing-replica-not-zeroed", file="pipeoff/ft/_collective.py",
        old="    if manager.is_participating() is False:\n",
        new="    if False:\n",
        tests=("tests/ft/test_peer_failed.py",),
        hazard="a healing replica's stale values summed into its peers' average, divided "
               "by a participant count without it"),
    Mutant(
        name="r77:zero-grads-set-to-none", file="pipeoff/optim/_full_offload/_intake.py",
        old="        p.grad = None if set_to_none or id(p) not in held else torch.zeros_like(p)\n",
        new="        p.grad = None\n",
        tests=("tests/optim/test_full_offload_loops.py::test_zero_grad_set_to_none_false_"
               "steps_a_parameter_without_a_gradient_as_torch",),
        hazard="after zero_grad(set_to_none=False) a parameter that gets no gradient is "
               "skipped where torch steps it with zeros"),
    Mutant(
        name="r78:torch-nn-root-compiled-code-kept", file="pipeoff/_compat.py",
        old="             *(c for c in (inline.__code__.co_consts if inline else ()) "
            "if hasattr(c, \"co_code\"))}\n",
        new="             }\n",
        tests=("tests/optim/test_patterns.py::test_a_torch_nn_root_compiled_before_attach_"
               "runs_with_the_hooks",),
        hazard="an nn.Sequential compiled before attach() keeps running code without the "
               "hooks' waits and reads weights the step is still writing"),
    Mutant(
        name="r79:torn-by-zero-grad-kept-quiet", file="pipeoff/optim/_full_offload/_intake.py",
        old="    if before is None and health.torn is not None:\n",
        new="    if False:\n",
        tests=("tests/optim/test_full_offload.py::test_zero_grad_after_a_raised_final_backward_"
               "that_stepped_chunks_refuses",),
        hazard="the loop trains on after zero_grad() on weights a failed final backward "
               "had partly stepped"),
    Mutant(
        name="r80:abandoned-sync-not-voted", file="pipeoff/ft/_diloco_fragment.py",
        old="        with contextlib.suppress(BaseException):\n            self._vote()\n",
        new="        pass\n",
        tests=("tests/ft/test_peer_failed.py::test_a_replica_that_leaves_after_its_all_"
               "reduces_lets_its_peer_commit",),
        hazard="a replica that abandons a sync and leaves never joins its vote: the peer "
               "waits out the group's timeout and rejects, where torchft's commits"),
    Mutant(
        name="r81:grads-taken-early-forgotten", file="pipeoff/optim/_full_offload/_intake.py",
        old="            | ((intake.delivered | taken) - shown))\n",
        new="            | (intake.delivered - shown))\n",
        tests=("tests/optim/test_full_offload_loops.py::test_zero_grad_set_to_none_false_"
               "follows_torchs_grad",),
        hazard="a zero .grad that the loop's clip call took into a device-part sum is "
               "forgotten: the next zero_grad(set_to_none=False) leaves it None and the "
               "parameter is skipped where torch steps it"),
    Mutant(
        name="r82:load-drops-device-grads", file="pipeoff/optim/_full_offload/_device_part.py",
        old="        for rec in self.params.values():\n            rec.sum = None\n",
        new="        for rec in self.params.values():\n            rec.sum = None\n"
            "            rec.param.grad = None\n",
        tests=("tests/optim/test_full_offload_loops.py::test_zero_grad_set_to_none_false_"
               "follows_torchs_grad",),
        hazard="load_state_dict() drops the device part's .grad (torch's keeps it), so the "
               "result depends on offload_fraction"),
    Mutant(
        name="r83:backward-after-a-raised-one", file="pipeoff/optim/_full_offload/_common.py",
        old="        and now[1] is not began_in[1]\n",
        new="        and False\n",
        tests=("tests/optim/test_full_offload.py::test_a_backward_after_one_that_raised_is_"
               "refused_naming_it",),
        hazard="a backward after one that raised is taken as the same backward: refused as "
               "a reentrant checkpoint's second gradient, or (a device part) its gradients "
               "added to the partial ones"),
    Mutant(
        name="r84:guarded-grads-shrink", file="pipeoff/optim/_offload/_graph.py",
        old="        ref = self.grad_refs.get(i)\n",
        new="        ref = self.grad_refs.get(i) if i in self.restore else None\n",
        tests=("tests/optim/test_optim_cuda.py::test_grads_zeroed_in_place_wait_with_a_"
               "device_part",),
        hazard="the read guard knows only the gradients of chunks not yet issued when the "
               "forward waits begin (after the device part steps): zeroing the others in "
               "place races the compute stream's kernels still reading them"),
    Mutant(
        name="r85:backward-mark-ignores-the-thread", file="pipeoff/optim/_full_offload/_common.py",
        old="    return began_in is not None and now is not None and now[0] == began_in[0] \\\n",
        new="    return began_in is not None and now is not None and True \\\n",
        tests=("tests/optim/test_full_offload.py::test_backwards_on_two_threads_at_once_are_"
               "not_taken_for_a_raised_one",),
        hazard="a backward on another thread, running while this one is, taken for a backward "
               "after one that raised: legitimate concurrent backwards refused"),
    Mutant(
        name="r86:abandoned-micro-step-keeps-its-frame",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="        ms.ended, ms.began_in = True, None\n        if self.micro is ms:\n"
            "            self.micro = None\n        if err is None:\n",
        new="        ms.ended = True\n        if self.micro is ms:\n"
            "            self.micro = None\n        if err is None:\n",
        tests=("tests/optim/test_full_offload.py::test_a_raised_backwards_graph_is_freed_by_"
               "zero_grad",),
        hazard="a raised backward's micro-step keeps its frame after zero_grad(): the loss, "
               "the graph and its saved activations stay alive through the retry"),
    Mutant(
        name="r88:local-sgd-ctrl-c-skips-the-vote", file="pipeoff/ft/_local_sgd.py",
        old="            elif ex is not None and \"voted\" not in commit and "
            "is_failure_of(err, ex):\n",
        new="            elif False:\n",
        tests=("tests/ft/test_peer_failed.py::test_ctrl_c_in_a_sync_still_lets_the_peer_"
               "commit",),
        hazard="Ctrl-C in a LocalSGD sync's task (the synchronous schedule's all-reduce "
               "wait): the replica leaves without its vote, and the healthy peer waits out "
               "the group's timeout and rejects, where torchft's peer commits"),
    Mutant(
        name="r89:diloco-ctrl-c-skips-the-vote", file="pipeoff/ft/_diloco_fragment.py",
        old="                    if not is_failure_of(failure, ex):\n",
        new="                    if True:\n",
        tests=("tests/ft/test_peer_failed.py::test_ctrl_c_while_a_diloco_sync_waits_before_"
               "its_decision_lets_the_peer_commit",),
        hazard="Ctrl-C before a DiLoCo sync's decision: the wait for its all-reduces "
               "re-raises the interrupt the commit gate was failed with, and the vote is "
               "skipped: the healthy peer rejects after the group's timeout"),
    Mutant(
        name="r90:full-load-unmarked", file="pipeoff/optim/_full_offload/_device_part.py",
        old="        if self.params:  # (after a load too: the readers off the caller's stream "
            "wait)\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload_fraction_cuda.py::test_a_reader_off_the_"
               "callers_stream_after_load_state_dict_waits",),
        hazard="a reader off the caller's stream after load_state_dict() and wait_for_step() "
               "reads device-part weights the load's copies are still writing"),
    Mutant(
        name="r91:offload-load-unmarked", file="pipeoff/optim/offload.py",
        old="            self._device.mark(self.inner)  # (the device part's loaded state: for "
            "the readers)\n",
        new="",
        tests=("tests/optim/test_optim_cuda.py::test_a_reader_off_the_callers_stream_after_"
               "load_state_dict_waits",),
        hazard="a reader off the caller's stream after load_state_dict() and wait_for_step() "
               "reads device-part state the load's copies are still writing"),
    Mutant(
        name="r92:speculative-step-ignores-the-loops-access", file="pipeoff/ft/_outer_spec.py",
        old="        return self._accessed or self.outer.state_versions(\n",
        new="        return self.outer.state_versions(\n",
        tests=("tests/ft/test_diloco_speculative.py::test_state_edited_in_place_before_the_"
               "decision_is_the_state_stepped[sgd-foreach_under_a_mode]",),
        hazard="the loop edits the outer state with a foreach op under a TorchDispatchMode "
               "(no version bump) before the decision: the speculative step taken from the "
               "state before the edit is kept, and the edit is lost"),
    Mutant(
        name="r93:own-reads-drop-the-speculative-step", file="pipeoff/ft/_diloco.py",
        old="        if not own_read():\n",
        new="        if True:\n",
        tests=("tests/ft/test_diloco_speculative.py::test_a_loop_that_leaves_the_outer_state_"
               "alone_keeps_the_speculative_step",),
        hazard="pipeoff's own reads of the user's outer state count as the loop's: every "
               "speculative outer step is dropped and taken again after the decision"),
    Mutant(
        name="r94:a-bitless-write-counts-by-version", file="pipeoff/optim/_full_offload/_grads.py",
        old="        return not _same_bits(flat(real, slot.rec.order).to(acc.device), "
            "acc.to(real.dtype))\n",
        new="        return real._version > 0 or not _same_bits(flat(real, slot.rec.order)"
            ".to(acc.device), acc.to(real.dtype))\n",
        tests=("tests/optim/test_full_offload_fraction_loop.py::test_a_clip_that_changes_no_"
               "bit_after_a_read_steps_the_sums[1.0]",),
        hazard="a write to the real gradient that changes no bit (the clip's multiply by "
               "1.0) counts as a write by its version counter: the step takes the BF16 "
               "cast, where the same loop under a dispatch mode takes the FP32 sums"),
    Mutant(
        name="r95:failed-step-counts-unread", file="pipeoff/optim/_update.py",
        old="    if any(c is None or step_count(st.get(\"step\")) > c\n",
        new="    if False and any(c is None or step_count(st.get(\"step\")) > c\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_device_part_failure_after_"
               "it_wrote_is_torn[under_a_dispatch_mode]",),
        hazard="a device-part step that raised after writing masters under a dispatch mode "
               "(no version bump) says no master was stepped, and the next step goes on "
               "from the torn state"),
    Mutant(
        name="r96:failed-step-under-a-mode-trusted", file="pipeoff/optim/_update.py",
        old="    blind = _compat.dispatch_mode_active() or any(\n",
        new="    blind = False or any(\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_failed_step_is_told_written_"
               "by_its_state_and_under_a_mode_without_counts",),
        hazard="an optimizer without step counts (SGD) that raised mid-step under a dispatch "
               "mode is taken as having written nothing"),
    Mutant(
        name="r97:speculation-unwatched-without-a-tail", file="pipeoff/ft/_diloco.py",
        old="            isinstance(f, OffloadedFragment) and f.speculates for f in "
            "self._fragments)\n",
        new="            False for f in self._fragments)\n",
        tests=("tests/ft/test_diloco_speculative.py::test_a_state_edit_before_the_decision_"
               "is_the_state_stepped[full_offload-foreach_under_a_mode]",),
        hazard="over FullOffloadOptimizer (no sync tail) the outer state is a plain dict: "
               "the loop's access before the decision goes unseen and a foreach edit under "
               "a dispatch mode is lost"),
    Mutant(
        name="r98:failed-step-state-unread", file="pipeoff/optim/_update.py",
        old="    if tuple(p._version for p in params) != marks.versions or any(\n",
        new="    if tuple(p._version for p in params) != marks.versions or False and any(\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_device_part_failure_after_"
               "it_wrote_state_only_is_torn[full_offload]",),
        hazard="torch's SGD writes its momentum, then raises before any parameter: the step "
               "is taken as clean and retried, advancing the momentum twice"),
    Mutant(
        name="r99:outer-state-rewrapped-after-syncs-only", file="pipeoff/ft/_diloco.py",
        old="        if chosen is not None and self._watches_outer_state():\n",
        new="        if self._local_step == 0 and chosen is not None and "
            "self._watches_outer_state():\n",
        tests=("tests/ft/test_diloco_speculative.py::test_a_state_edit_before_the_decision_"
               "is_the_state_stepped[sgd-loaded_then_foreach]",),
        hazard="after the loop's load_state_dict() of the outer optimizer before a "
               "preparation, its plain dict is shown until the sync ends: an edit under a "
               "dispatch mode before the decision is lost"),
    Mutant(
        name="r100:failed-sgd-step-on-dtensors-trusted", file="pipeoff/optim/_update.py",
        old="        _compat.local_tensor(p) is not p for p in params)\n",
        new="        False for p in params)\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_failed_step_is_told_written_"
               "by_its_state_and_under_a_mode_without_counts",),
        hazard="SGD over FSDP2's DTensors raising mid-step after foreach writes (no version "
               "bump): taken as clean and retried"),
    Mutant(
        name="r101:nan-payloads-differ", file="pipeoff/optim/_full_offload/_grads.py",
        old="        same |= a.isnan() & b.isnan()\n",
        new="        same = same\n",
        tests=("tests/optim/test_full_offload_fraction_loop.py::test_nans_of_other_payloads_"
               "are_the_same_bits",),
        hazard="a read of a NaN gradient cast on the device (another NaN payload) counts as "
               "a write: the step takes the cast, or max_norm refuses it"),
    Mutant(
        name="r102:failed-enter-keeps-its-hooks", file="pipeoff/ft/_diloco.py",
        old="            self._uninstall()\n            raise\n",
        new="            raise\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_failed_enter_leaves_nothing_installed",),
        hazard="a DiLoCo whose __enter__ raised leaves forward waits on the model and the "
               "outer optimizers' state wrapped, for syncs that will never run"),
    Mutant(
        name="r103:closed-stream-drops-work", file="pipeoff/testing/_simstreams.py",
        old="            if not self._exited:\n",
        new="            if True:\n",
        tests=("tests/test_simcuda.py::test_an_execution_left_in_flight_when_the_device_"
               "exits_still_finishes",),
        hazard="work enqueued after the simulated device closed never runs: a test that "
               "leaves the block with an execution in flight hangs 40 s at exit"),
    Mutant(
        name="r104:state-assigned-under-a-step", file="pipeoff/optim/offload.py",
        old=("        self.wait_for_step()  # Hazard: the step in flight writing into the "
             "dicts given\n"),
        new="",
        tests=("tests/optim/test_overlap.py::test_assigning_state_waits_for_the_step_in_"
               "flight[snapshot]",),
        hazard="opt.state = snapshot right after step(): the step in flight writes its step "
               "counts into the snapshot's dicts, and the bias correction is off"),
    Mutant(
        name="r105:transfer-overlap-per-storage", file="pipeoff/transfer/_live.py",
        old="    return str(t.device), base + start * size, base + end * size\n",
        new="    return str(base), start * size, end * size\n",
        tests=("tests/transfer/test_transfer.py::test_memory_shared_by_two_storages_is_"
               "compared_by_address[source]",),
        hazard="a target overlapping a source through another storage of one buffer is "
               "transferred, reading bytes it already overwrote"),
    Mutant(
        name="r106:local-sgd-logical-order", file="pipeoff/ft/_local_sgd.py",
        old="    if t.is_contiguous() or t.dim() < 2:\n",
        new="    if True:\n",
        tests=("tests/ft/test_local_sgd_three.py::test_three_groups_average_bitwise_as_"
               "torchft[synchronous]",),
        hazard="a transposed weight all-reduced in logical order: 1 ulp off torchft with "
               "three replica groups"),
    Mutant(
        name="r107:unissued-all-reduce-joins-on", file="pipeoff/ft/_collective.py",
        old="        # Not issued: the later collectives are skipped (see Link).\n"
            "        link.broken = True\n",
        new="        # Not issued: the later collectives are skipped (see Link).\n"
            "        pass\n",
        tests=("tests/ft/test_local_sgd_peers.py::test_an_all_reduce_that_could_not_be_"
               "issued_fails_the_sync_on_both[sync]",
               "tests/ft/test_peer_failed.py::test_a_diloco_all_reduce_that_could_not_be_"
               "issued_fails_the_sync_on_both"),
        hazard="a replica whose all-reduce could not be issued joins the later ones one "
               "behind its peers': gloo aborts the process on the size mismatch"),
    Mutant(
        name="r108:device-only-backward-hides-host-sums",
        file="pipeoff/optim/_full_offload/_fraction.py",
        old="                super()._show()\n",
        new="                pass\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_the_loops_clip_sees_host_"
               "sums_after_a_backward_with_device_gradients_only[0.5-none-cpu]",),
        hazard="after a backward with device-part gradients only, the host part's sums are "
               "not in .grad: the loop's clip leaves them out of the norm, silently"),
    Mutant(
        name="r109:dtensor-writes-unseen", file="pipeoff/optim/_tensors.py",
        old="    return param._version, local._version, data\n",
        new="    return 0, local._version, data\n",
        tests=("tests/optim/test_dtensor.py::test_full_offload_sees_weights_written_through_"
               "the_dtensor[none-1.0]",),
        hazard="a weight written through its DTensor (a model loaded under FSDP2) is not "
               "seen: the next step writes the old masters back over it"),
    Mutant(
        name="r110:ctrl-c-mid-withdraw", file="pipeoff/optim/_full_offload/_grads.py",
        old="            with held.hold():\n",
        new="            if True:\n",
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_while_step_takes_the_"
               "placeholders_out_is_held_back[none]",),
        hazard="a Ctrl-C between two placeholders taken out of .grad at step(): the retried "
               "step() takes the ones gone as dropped, and steps without them"),
    Mutant(
        name="r111:ctrl-c-after-a-whole-step-tears-it",
        file="pipeoff/optim/_full_offload/_fraction.py",
        old="                    and acc.execution.exception is not None):\n",
        new="                    and True):\n",
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_once_the_step_ended_whole_"
               "does_not_tear_it[0.5]",),
        hazard="a Ctrl-C after a step with a device part ended whole marks it torn: every "
               "later step refused until a checkpoint is loaded"),
    Mutant(
        name="r112:write-between-micro-steps-not-adopted-before-the-final-backward",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="            self.model_sync.adopt_outside_writes()\n",
        new="            pass\n",
        tests=("tests/optim/test_full_offload_loops.py::test_a_weight_written_between_micro_"
               "steps_under_backward_overlap_is_kept[count-1.0]",),
        hazard="under overlap='backward' a weight written between micro-steps is not adopted "
               "before the final backward's chunks step from the masters: step() refuses it "
               "as written late, or the chunks write the old masters back over it"),
    Mutant(
        name="r113:device-first-backward-not-counted",
        file="pipeoff/optim/_full_offload/_fraction.py",
        old="                self._begin(non_final)\n",
        new="                pass\n",
        tests=("tests/optim/test_full_offload_accumulation_steps.py::test_one_backward_more_"
               "than_the_count_is_refused[none-0.0]",),
        hazard="at offload_fraction=0 no backward is counted: one more than "
               "gradient_accumulation_steps (or past a no_sync()-marked final one) is summed "
               "into the step without a word"),
    Mutant(
        name="r114:state-dict-writes-unseen",
        file="pipeoff/optim/_full_offload/_model_sync.py",
        old="        by_content = self.state_dict_taken\n",
        new="        by_content = False\n",
        tests=("tests/optim/test_full_offload_fsdp2.py::test_weights_written_through_the_"
               "models_state_dict_are_kept[1.0-to_local]",),
        hazard="under FSDP2 a weight written through the model's state_dict() (DCP loading "
               "in place) bumps no version counter: the next step writes the old masters "
               "back over it"),
    Mutant(
        name="r115:load-sees-written-weights-by-versions-only",
        file="pipeoff/optim/_full_offload/_checkpoint.py",
        old="    return version_of(rec.param) != rec.version or not casts_to(\n",
        new="    return version_of(rec.param) != rec.version or False and casts_to(\n",
        tests=("tests/optim/test_full_offload_loops.py::test_a_load_takes_weights_written_"
               "where_no_version_counter_moved[1.0]",),
        hazard="a checkpoint's weights loaded in place (no version counter moved) lose to "
               "a fresh optimizer's masters at load_state_dict(): training restarts from "
               "the init"),
    Mutant(
        name="r116:diloco-syncs-after-a-late-failure",
        file="pipeoff/ft/_diloco.py",
        old="            self._refuse_after_a_late_failure()\n",
        new="            pass\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_failed_write_reaches_the_next_forward_"
               "once_and_is_reported",),
        hazard="after a DiLoCo sync failed after its decision, torchft's next quorum "
               "forgets the error reported: the replica averages and commits its partly "
               "written model, never healed"),
    Mutant(
        name="r117:ctrl-c-mid-launch",
        file="pipeoff/optim/offload.py",
        old="            with held.hold(), held.passed_on(lambda: \"\", drop_only=True):\n",
        new="            with contextlib.nullcontext():\n",
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_between_two_lanes_submissions_"
               "is_held_back[forward_waits-1.0-overlap]",),
        hazard="a Ctrl-C between two lanes' submissions of OffloadOptimizer's step: a "
               "half-launched step, which the retried step() launches again over"),
    Mutant(
        name="r118:diloco-tail-failure-after-a-ctrl-c-dropped",
        file="pipeoff/ft/_diloco_tail.py",
        old="            failure = err if isinstance(err, Exception) else ex.exception\n",
        new="            failure = err if isinstance(err, Exception) else None\n",
        tests=("tests/ft/test_diloco_tail.py::test_a_ctrl_c_in_the_tail_wait_keeps_a_failure_"
               "that_comes_after_it",),
        hazard="a Ctrl-C while waiting for DiLoCo's tail, which then fails: the failure "
               "is never reported and later syncs commit the partly written model"),
    Mutant(
        name="r119:ctrl-c-out-of-step-without-a-note",
        file="pipeoff/optim/offload.py",
        old=("                _join.note_interrupted_step(err, launched=self._last is not "
             "launched)\n"),
        new="                pass\n",
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_outside_the_holds_says_whether_"
               "the_step_was_launched[once_in_flight]",),
        hazard="a Ctrl-C out of step() once its step is in flight, with no note: a caller "
               "who retries takes the step twice"),
    Mutant(
        name="r120:model-of-a-device-only-optimizer-never-found",
        file="pipeoff/optim/full_offload.py",
        old=("            self._finder = ModelFinder(self._lifecycle.all_tensors, "
             "self._found_model)\n"),
        new=("            self._finder = ModelFinder(self._registry.tensors, "
             "self._found_model)\n"),
        tests=("tests/optim/test_full_offload_fsdp2.py::test_more_weights_written_through_"
               "the_models_state_dict_are_kept[params_fraction_0]",),
        hazard="an optimizer built from parameters at offload_fraction=0 never finds its "
               "model: a write through its FSDP2 state_dict() is undone by the next step"),
    Mutant(
        name="r121:backward-starts-without-the-bucket-views-chunks",
        file="pipeoff/optim/_waits.py",
        old="            self.before_backward()\n        if self.writes_only:",
        new="            pass\n        if self.writes_only:",
        tests=("tests/optim/test_overlap_ddp.py::test_an_unused_modules_gradients_in_ddps_"
               "buckets_are_read_before_the_next_backward[1.0-False-True]",
               "tests/optim/test_overlap_ddp.py::test_gradients_in_a_bucket_on_a_cuda_device"
               "[simulated-False-True]"),
        hazard="the read guard lets a backward begin while the step in flight still reads "
               "gradients in DDP's buckets: DDP zeroes an unused module's, whose step reads "
               "zeros"),
    Mutant(
        name="r122:attached-forward-ends-without-the-bucket-views-chunks",
        file="pipeoff/optim/_hooks.py",
        old="    if torch.is_grad_enabled():\n        waits.before_backward()\n",
        new="    if torch.is_grad_enabled():\n        pass\n",
        tests=("tests/optim/test_overlap_ddp.py::test_an_unused_modules_gradients_in_ddps_"
               "buckets_are_read_before_the_next_backward[1.0-True-False]",
               "tests/optim/test_overlap_ddp.py::test_gradients_in_a_bucket_on_a_cuda_device"
               "[simulated-True-False]"),
        hazard="an attached model without the read guard begins its backward while the step "
               "in flight still reads gradients in DDP's buckets"),
    Mutant(
        name="r123:gradient-views-not-seen-as-in-a-bucket",
        file="pipeoff/optim/_waits.py",
        old="                if _in_a_bucket(tensors[-1]):\n",
        new="                if False:\n",
        tests=("tests/optim/test_overlap_ddp.py::test_an_unused_modules_gradients_in_ddps_"
               "buckets_are_read_before_the_next_backward[1.0-False-True]",),
        hazard="DDP's bucket views are not recognized: no backward waits for their chunks"),
    Mutant(
        name="r124:ranks-choose-auto-apart",
        file="pipeoff/optim/_offload/_auto.py",
        old=("    if over is not None:  # (the ranks of process_group check the plan "
             "collectively)\n"),
        new="    if False:\n",
        tests=("tests/optim/test_offload_auto.py::test_ranks_agree_on_what_auto_chooses_from",),
        hazard="each rank chooses offload_fraction='auto' from its own budget and rates: "
               "the plan check fails on every rank"),
    Mutant(
        name="r126:gate-opening-through-the-condition",
        file="pipeoff/executor/_gates.py",
        old=("        with self._lock:\n            if self.simulated:\n                return  # "
             "the simulator opened it at launch"),
        new=("        with self._cond:\n            if self.simulated:\n                return  # "
             "the simulator opened it at launch"),
        tests=("tests/test_lane_locks.py::test_a_ctrl_c_inside_a_gates_opening_leaves_the_"
               "gates_working",),
        hazard="a Ctrl-C in Condition.__exit__ while the main thread opens a gate leaves the "
               "gates' lock held: every lane waiting on a gate blocks for good"),
    Mutant(
        name="r127:auto-on-one-rank-only-not-checked",
        file="pipeoff/optim/_offload/_auto.py",
        old="        _auto_on_every_rank_or_none(auto, optimizer, process_group)\n",
        new="        pass\n",
        tests=("tests/optim/test_offload_auto.py::test_auto_on_one_rank_only_is_refused_on_"
               "every_rank",),
        hazard="a rank asking for 'auto' agrees while another is in the plan check: the "
               "collectives meet each other and both ranks block until the group's timeout"),
    Mutant(
        name="r128:local-sgd-ctrl-c-drops-a-failed-syncs-recovery",
        file="pipeoff/ft/_local_sgd.py",
        old="                        self._after_failure(failure, ex, buckets, device, link, "
            "commit)\n",
        new="                        pass\n",
        tests=("tests/ft/test_peer_failed.py::test_ctrl_c_in_a_pipelined_local_sgd_sync_is_"
               "passed_on_once_the_sync_has_ended[fails]",),
        hazard="a sync that failed after a Ctrl-C in the caller's wait is not reported to "
               "torchft: a partly averaged replica commits at its next sync"),
    Mutant(
        name="r129:idle-lane-keeps-its-last-batch",
        file="pipeoff/executor/threads.py",
        old="            del batch, item\n",
        new="            pass\n",
        tests=("tests/test_executor.py::test_an_idle_lane_keeps_nothing_of_its_last_execution",),
        hazard="an idle lane keeps its last execution alive through its last batch, a process "
               "group among what it closes over: gloo's threads outlive destroy_process_group "
               "into interpreter finalization (issue 37)"),
    Mutant(
        name="r130:gate-wait-without-a-recheck",
        file="pipeoff/executor/_gates.py",
        old="_RECHECK_S = 0.1\n",
        new="_RECHECK_S = 3600.0\n",
        tests=("tests/test_lane_locks.py::test_a_ctrl_c_inside_a_gates_opening_never_strands_a_"
               "parked_lane",),
        hazard="a Ctrl-C inside a gate's notify_all() on the main thread settles the gate "
               "without waking the lane parked on it: the lane sleeps for good"),
    Mutant(
        name="r131:full-offload-auto-on-one-rank-not-checked",
        file="pipeoff/optim/_full_offload/_auto.py",
        old="    check_same_fraction(fraction, flat)\n    choice = full_auto(",
        new="    choice = full_auto(",
        tests=("tests/optim/test_full_offload_fsdp2.py::test_auto_on_one_rank_only_is_refused_"
               "on_every_rank",),
        hazard="FSDP2 ranks asking for 'auto' agree while the others check their fraction: "
               "the two collectives meet, and gloo aborts the process (or the ranks hang)"),
    Mutant(
        name="r132:loop-read-ends-the-accumulation-before-its-edits",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old=("            self.grads.withdraw(stepping=False, keep=True)\n"
             "            acc = self.acc\n"),
        new="            acc = self.acc\n",
        tests=("tests/optim/test_full_offload_clip.py::test_a_gradient_dropped_or_replaced_"
               "before_the_loops_read_stays_so",),
        hazard="a gradient dropped or replaced before the loop's clip call: the final "
               "micro-step adds the replacement to the sum, and shows the dropped sum again, "
               "which steps"),
    Mutant(
        name="r133:another-optimizers-groups-loaded",
        file="pipeoff/optim/_full_offload/_checkpoint.py",
        old="        if missing:\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload.py::test_a_state_dict_of_another_optimizer_"
               "class_is_refused",),
        hazard="an SGD checkpoint loaded into AdamW steps on with its own betas and the "
               "checkpoint's lr, where torch's fails at the step"),
    Mutant(
        name="r134:weight-storage-swap-unseen",
        file="pipeoff/optim/_tensors.py",
        old="        data: Any = weakref.ref(local.untyped_storage())\n",
        new="        data: Any = None\n",
        tests=("tests/optim/test_full_offload.py::test_a_round_trip_through_bf16_between_"
               "steps_is_a_write_to_the_weights",),
        hazard="model.to(bfloat16) and back between steps swaps the weights' data and bumps "
               "no version counter: the next step steps the unrounded masters, not the "
               "weights torch steps"),
    Mutant(
        name="r135:adamw-loads-an-adam-checkpoints-flags",
        file="pipeoff/optim/_full_offload/_surface.py",
        old=("            _checkpoint.as_torch_loads(self._config.optimizer_class, self.defaults,\n"
             "                                       self.param_groups)\n"),
        new="",
        tests=("tests/optim/test_full_offload.py::test_an_adam_checkpoint_loads_into_adamw_as_"
               "torchs_does",),
        hazard="an Adam checkpoint loaded into AdamW keeps decoupled_weight_decay=False: the "
               "step decays as Adam's L2 term where torch's AdamW decouples it"),
    Mutant(
        name="r136:ctrl-c-before-the-forward-waits-begin",
        file="pipeoff/optim/full_offload.py",
        old="        with micro.part.interrupt.hold():\n",
        new="        if True:\n",
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_as_step_begins_the_forward_"
               "waits_is_held_until_they_have",),
        hazard="a Ctrl-C in step() after the chunks launched and before the forward waits "
               "began: no note, and the next forward reads weights the step still writes"),
    Mutant(
        name="r137:known-final-norm-misses-the-loops-edits",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="        if acc.final is None or self.grads.edited():\n",
        new="        if acc.final is None:\n",
        tests=("tests/optim/test_full_offload_clip.py::test_grad_norm_after_a_known_final_"
               "backward_counts_the_loops_edits",),
        hazard="opt.grad_norm after a known-final backward and a gradient dropped or "
               "replaced: the norm from before the edit (a dropped NaN skips the step)"),
    Mutant(
        name="r138:edited-gradients-not-normed-again",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="            acc.final.lanes.renorm(acc.results, [*replaced, *dropped])\n",
        new="            pass\n",
        tests=("tests/optim/test_full_offload_clip.py::test_grad_norm_after_a_known_final_"
               "backward_counts_the_loops_edits",),
        hazard="the final fold's norms kept for gradients the loop replaced or dropped "
               "after it: grad_norm from before the edit"),
    Mutant(
        name="r139:ctrl-c-inside-the-hand-over",
        file="pipeoff/optim/full_offload.py",
        old=("        with micro.part.interrupt.hold():\n"
             "            acc = micro.hand_over(hyper, edits)\n"),
        new=("        acc = micro.hand_over(hyper, edits)\n"
             "        with micro.part.interrupt.hold():\n"),
        tests=("tests/optim/test_interrupts.py::test_a_ctrl_c_inside_the_hand_over_once_the_"
               "chunks_may_go_is_held",),
        hazard="a Ctrl-C in the hand-over once the chunks may go: with a device part, its "
               "step skipped (weights off torch, no error) or the step reported torn"),
    Mutant(
        name="r140:state-key-dropped-when-unused",
        file="pipeoff/optim/_full_offload/_lanes.py",
        old="                (*rec.present, *_update.state_keys(",
        new="                (*(), *_update.state_keys(",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_state_key_a_hyperparameter_stops_using_is_kept",),
        hazard="momentum 0 (amsgrad off) for a step drops the buffer: a fresh one after, "
               "or a KeyError, where torch goes on from it"),
    Mutant(
        name="r141:state-entry-write-dropped",
        file="pipeoff/optim/_full_offload/_state_view.py",
        old="        self._write(self._param, new)\n",
        new="        pass\n",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_write_into_opt_state_is_what_the_next_step_steps_from",),
        hazard="opt.state[p]['step'] = t (or a value, or clear()) accepted and dropped: the "
               "next step steps from the old state"),
    Mutant(
        name="r142:state-write-without-the-step-wait",
        file="pipeoff/optim/_full_offload/_surface.py",
        old="        # still reads and writes.\n        self._quiesce()\n",
        new="        # still reads and writes.\n        pass\n",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_write_through_a_view_kept_across_a_step_waits_for_that_step",),
        hazard="a write into opt.state while the step in flight writes the state: the "
               "step's chunks overwrite it"),
    Mutant(
        name="r143:new-module-not-named",
        file="pipeoff/optim/_full_offload/_param.py",
        old="        if name is None and self.model is not None:\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_module_added_to_the_model_after_construction_is_stepped",),
        hazard="a module added to the model after construction refused by add_param_group "
               "as not in the model"),
    Mutant(
        name="r144:forward-before-step-reads-chunk-writes",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="        life.settle_final_backward()\n",
        new="        pass\n",
        tests=("tests/optim/test_full_offload_loops.py::test_a_forward_after_the_final_"
               "backward_under_overlap_backward_waits_for_its_chunks",),
        hazard="under overlap='backward' a forward before step() reads the weights the "
               "final backward's chunks still write"),
    Mutant(
        name="r145:kept-view-writes-its-old-entry",
        file="pipeoff/optim/_full_offload/_state_view.py",
        old="        return self._read(self._param)\n",
        new="        return dict(self)\n",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_kept_view_and_a_popped_entry_behave_as_torchs",),
        hazard="one key written through a view kept across steps puts back the step count "
               "of when it was read"),
    Mutant(
        name="r146:popped-state-stepped-into",
        file="pipeoff/optim/_full_offload/_checkpoint.py",
        old="    rec.state.clear()\n    rec.state.update(state)\n",
        new="    rec.state.update(state)\n",
        tests=("tests/optim/test_full_offload_state_edits.py::test_a_kept_view_and_a_popped_entry_behave_as_torchs",),
        hazard="an entry popped (or replaced) keeps the host tensors the next step starts "
               "the new state in: the caller's copy changes"),
    Mutant(
        name="r147:every-gradient-dropped-norm-none",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="            return torch.zeros(()) if had and self.acc is None else None\n",
        new="            return None\n",
        tests=("tests/optim/test_full_offload_clip.py::test_grad_norm_with_every_gradient_"
               "dropped_is_zero_as_torchs",),
        hazard="every gradient dropped: grad_norm None (torch's clip gives 0), and the "
               "skip-on-non-finite pattern raises TypeError"),
    Mutant(
        name="r148:cuda-gate-check-dropped",
        file="pipeoff/executor/cuda.py",
        old="            run.check_gate_event(k)\n",
        new="            pass\n",
        tests=("tests/test_gates.py::test_a_later_failure_of_the_task_a_payload_is_ready_"
               "after_reaches_a_cuda_reader",),
        hazard="a CUDA lane goes on from another execution's task that failed after the "
               "gate opened: the next micro-step folds on without the failed one's sum"),
    Mutant(
        name="r149:host-gate-check-dropped",
        file="pipeoff/executor/_run.py",
        old="                self.check_gate_event(k)\n",
        new="                pass\n",
        tests=("tests/test_gates.py::test_a_later_failure_of_the_task_a_payload_is_ready_"
               "after_reaches_the_reader",),
        hazard="a host lane goes on from another execution's task that failed after the "
               "gate opened: its payload never written, its failure lost"),
    Mutant(
        name="r150:full-load-entry-unchecked",
        file="pipeoff/optim/_full_offload/_checkpoint.py",
        old="        _update.check_loaded_entry(f\"parameter {pid} ({name!r})\", entry, "
            "required_of[pid])\n",
        new="        pass\n",
        tests=("tests/optim/test_load_refusals.py",),
        hazard="a checkpoint with a meta tensor, step=None or a missing moment is half "
               "loaded into FullOffloadOptimizer: later steps fail, or start state afresh"),
    Mutant(
        name="r151:offload-load-entry-unchecked",
        file="pipeoff/optim/_offload/_host_layout.py",
        old="                _update.check_loaded_entry(f\"parameter {pid}\", entry,\n",
        new="                (lambda *a: None)(f\"parameter {pid}\", entry,\n",
        tests=("tests/optim/test_load_refusals.py",),
        hazard="OffloadOptimizer half-loads a bad checkpoint and steps on a mix of two"),
    Mutant(
        name="r152:backward-load-after-final-allowed",
        file="pipeoff/optim/_full_offload/_surface.py",
        old="        raise ConfigError(\n            \"load_state_dict() between the final "
            "backward and step() under \"\n",
        new="        return\n        raise ConfigError(\n            \"load_state_dict() between "
            "the final backward and step() under \"\n",
        tests=("tests/optim/test_full_offload.py::test_checkpoints_between_the_final_"
               "backward_and_step_are_refused",),
        hazard="a load after the final backward under overlap='backward' drops that "
               "backward's gradients: step() steps nothing, torch steps on them"),
    Mutant(
        name="r153:backward-state-dict-a-step-ahead",
        file="pipeoff/optim/_full_offload/_surface.py",
        old="        if (acc is not None and acc.final is not None\n",
        new="        if (acc is not None and acc.final is not None "
            "and self._lifecycle.part.params\n",
        tests=("tests/optim/test_full_offload.py::test_checkpoints_between_the_final_"
               "backward_and_step_are_refused",),
        hazard="a checkpoint between the final backward and step() holds that step: a "
               "resume applies the batch twice"),
    Mutant(
        name="r154:kept-grads-not-restored",
        file="pipeoff/optim/_full_offload/_lifecycle.py",
        old="        self.grads.restore_kept()  # (after the folds",
        new="        pass  # (after the folds",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_foreach_writes_over_gradients_taken_before_a_read_reach_the_step",),
        hazard="a foreach write after a read reaches a tensor no longer in .grad: unclipped"),
    Mutant(
        name="r155:grad-data-set-on-the-placeholder",
        file="pipeoff/optim/_full_offload/_placeholder.py",
        old="                          torch.Tensor.data.__set__})",
        new="                          })",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_grad_data_and_set_are_what_steps",),
        hazard="g.data = t on a gradient placeholder is read by nothing: the old sum steps"),
    Mutant(
        name="r156:grad-set-refused",
        file="pipeoff/optim/_full_offload/_grads.py",
        old="        if func.overloadpacket is aten.set_:\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_grad_data_and_set_are_what_steps",),
        hazard="grad.set_(t) raises an error about DTensors on a plain model"),
    Mutant(
        name="r157:the-loops-own-grad-hook-unseen",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="        if why is not None:  # (a tester's find",
        new="        if False:  # (a tester's find",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_a_post_accumulate_grad_hook_"
               "registered_later_is_refused_at_the_backward",
               "tests/optim/test_full_offload_loop_writes.py::test_such_a_hook_in_a_later_"
               "backward_of_an_accumulation_is_refused"),
        hazard="the loop's own post-accumulate-grad hook sees None or one backward's gradient"),
    Mutant(
        name="r158:float64-masters",
        file="pipeoff/optim/_full_offload/_param.py",
        old="            if p.dtype == torch.float64:",
        new="            if False:",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_a_float64_parameter_is_refused",),
        hazard="a float64 model trains with FP32 masters, silently"),
    Mutant(
        name="r159:offload-load-not-held",
        file="pipeoff/optim/offload.py",
        old="        with held_through(\"load_state_dict() wrote the optimizer's state\"):\n",
        new="        with contextlib.nullcontext():\n",
        tests=(f"{_IL}::test_a_ctrl_c_while_load_state_dict_writes_is_passed_on_after_a_whole_load",),
        hazard="a Ctrl-C between two parameters' entries: old state and new, mixed"),
    Mutant(
        name="r160:full-offload-load-not-held",
        file="pipeoff/optim/_full_offload/_surface.py",
        old=("        with held_through(\"load_state_dict() wrote the optimizer's state and "
             "weights\"):"),
        new="        if True:",
        tests=(f"{_IL}::test_a_ctrl_c_while_load_state_dict_writes_is_passed_on_after_a_whole_load",),
        hazard="a Ctrl-C between two parameters' masters: some loaded, the weights not"),
    Mutant(
        name="r161:single-pass-ctrl-c-says-step-again",
        file="pipeoff/optim/_offload/_graph.py",
        old="        if isinstance(err, KeyboardInterrupt):\n",
        new="        if False:\n",
        tests=(f"{_IL}::test_a_ctrl_c_inside_a_single_pass_step_does_not_say_to_step_again",),
        hazard="a Ctrl-C inside single_pass's step says to step again: some parameters twice"),
    Mutant(
        name="r162:unfrozen-parameter-silent",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="        if owner is None and id(p) in self.frozen_at_build:\n",
        new="        if False:\n",
        tests=("tests/optim/test_constructors.py::test_a_parameter_frozen_when_the_model_form_"
               "was_built_warns_once_unfrozen",),
        hazard="a parameter unfrozen after a warm-up is never stepped, silently"),
    Mutant(
        name="r163:torchfts-allreduce-raising-joins-the-rest",
        file="pipeoff/ft/_collective.py",
        old="            # propagating error skips them; the peers time out and reject.\n"
            "            link.broken = True\n",
        new="            # propagating error skips them; the peers time out and reject.\n"
            "            pass\n",
        tests=("tests/ft/test_peer_failed.py::test_an_error_out_of_torchfts_allreduce_skips_"
               "the_later_collectives",),
        hazard="a Ctrl-C in torchft's allreduce: the later all-reduces join one behind the "
               "peer's and gloo aborts the process"),
    Mutant(
        name="r164:diloco-clean-exit-abandons-silently",
        file="pipeoff/ft/_diloco.py",
        old="            if dropped and exc_value is None:",
        new="            if False:",
        tests=("tests/ft/test_diloco.py::test_a_block_that_ends_cleanly_with_a_sync_in_flight_"
               "says_it_is_abandoned",),
        hazard="a with-block ended with a sync in flight drops it silently (torchft performs "
               "it after re-entry)"),
    Mutant(
        name="r165:an-older-optimizers-hook-is-ours",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="            ours = ours or h.ref() is intake\n",
        new="            ours = True\n",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_an_older_optimizers_hook_does_not_make_the_loops_hook_refused",),
        hazard="a hook registered between an old and a new optimizer is refused falsely"),
    Mutant(
        name="r166:later-backward-by-the-host-accumulation",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="        why = hook_refusal(p, id(p) in self.delivered, self)\n",
        new="        why = hook_refusal(p, False, self)\n",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_such_a_hook_in_a_second_backward_without_no_sync_is_refused",),
        hazard="a hook before the optimizer sees one backward's gradient of several, silently"),
    Mutant(
        name="r167:a-dropped-placeholder-read",
        file="pipeoff/optim/_full_offload/_grads.py",
        old="        if what != \"scaling\" and not self._current(slot):\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_a_placeholder_kept_after_its_gradient_was_dropped",),
        hazard="a placeholder kept after p.grad = None reads garbage memory (accumulate gpu)"),
    Mutant(
        name="r168:float64-after-a-cast",
        file="pipeoff/optim/_full_offload/_param.py",
        old="                if q.dtype == torch.float64:  # (cast after construction",
        new="                if False:  # (cast after construction",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_a_model_cast_to_float64_after_construction_is_refused",),
        hazard="model.double() after construction trains with FP32 masters, silently"),
    Mutant(
        name="r169:ctrl-c-taken-for-a-failed-step",
        file="pipeoff/optim/_full_offload/_surface.py",
        old=" is not None or isinstance(err, KeyboardInterrupt):",
        new=" is not None:",
        tests=(f"{_IL}::test_a_ctrl_c_with_no_step_in_flight_is_not_taken_for_a_failed_step",),
        hazard="a Ctrl-C in load_state_dict()'s first wait is swallowed"),
    Mutant(
        name="r170:unjoined-all-reduce-taken-for-joined",
        file="pipeoff/ft/_collective.py",
        old="    if _compat.skipped_by_torchft(work) and manager.errored() is not None:",
        new="    if False:",
        tests=("tests/ft/test_diloco_race.py",
               "tests/ft/test_local_sgd_peers.py::test_an_all_reduce_whose_issue_failed_once_"
               "is_joined_and_the_peer_commits"),
        hazard="an error the loop reports inside torchft's allreduce leaves the collective "
               "unjoined: the peer times out and rejects a sync torchft's peer commits"),
    Mutant(
        name="r171:raising-decision-keeps-local-values",
        file="pipeoff/ft/_diloco_fragment.py",
        old="            if deciding:\n",
        new="            if False:\n",
        tests=("tests/ft/test_diloco_commit_raises.py",),
        hazard="a should_commit() that raises leaves the local parameters where torchft's "
               "restore left the backup: a loop that catches it trains on other values"),
    Mutant(
        name="r172:edit-of-dropped-placeholders-raises",
        file="pipeoff/optim/_full_offload/_grads.py",
        old="        if slot.dropped:\n            return  # (no longer",
        new="        if False:\n            return  # (no longer",
        tests=("tests/optim/test_full_offload_loop_writes.py::test_a_foreach_edit_of_"
               "gradients_all_set_to_none_reaches_nothing",),
        hazard="a foreach edit of gradients the loop set to None raises a misleading error "
               "where torch's reaches nothing"),
    Mutant(
        name="r173:failed-join-before-the-quorum",
        file="pipeoff/ft/_collective.py",
        old="        manager.wait_quorum()\n        if manager.is_participating() is False:",
        new="        if manager.is_participating() is False:",
        tests=("tests/ft/test_failed_joins.py::test_a_failed_replica_joins_on_the_group_its_"
               "asynchronous_quorum_configured",),
        hazard="a failed replica joins on the process group before its asynchronous quorum "
               "reconfigured it: the later collectives one behind the peer's, gloo aborts"),
    Mutant(
        name="r174:ctrl-c-in-fill-escapes-the-join",
        file="pipeoff/ft/_collective.py",
        old="    except BaseException as err:  # noqa: BLE001 - raised once the collective is",
        new="    except Exception as err:  # noqa: BLE001 - raised once the collective is",
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_while_a_bucket_is_filled_joins_"
               "it_and_the_peer_rejects",),
        hazard="a Ctrl-C while a bucket is filled leaves it unjoined: the later all-reduces "
               "join one behind the peer's and gloo aborts the process"),
    Mutant(
        name="r175:half-filled-bucket-voted-fine",
        file="pipeoff/ft/_collective.py",
        old="        local_failure = err\n        link.unfilled = True\n",
        new="        local_failure = err\n",
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_while_a_bucket_is_filled_joins_"
               "it_and_the_peer_rejects",),
        hazard="a bucket a Ctrl-C left half-filled is averaged into the peer's commit"),
    Mutant(
        name="r176:checkpoint-with-stale-weights",
        file="pipeoff/optim/_full_offload/_surface.py",
        old='        self._health.check("state_dict()")\n',
        new='        self._health.check("state_dict()", stale=False)\n',
        tests=("tests/optim/test_full_offload.py::test_a_checkpoint_with_stale_weights_is_"
               "refused_until_they_are_refreshed",),
        hazard="an emergency checkpoint pairs the stepped masters with stale weights: the "
               "resume trains from the stale ones"),
    Mutant(
        name="r177:refresh-masters-while-stale",
        file="pipeoff/optim/_full_offload/_surface.py",
        old='        self._health.check("refresh_masters()")\n',
        new="",
        tests=("tests/optim/test_full_offload.py::test_a_failed_h2d_leaves_the_masters_as_"
               "the_truth",),
        hazard="refresh_masters() after a failed copy adopts the stale weights as masters: "
               "the step is lost"),
    Mutant(
        name="r178:ctrl-c-in-write-back-unreported",
        file="pipeoff/ft/_local_sgd.py",
        old=('            elif ex is not None and commit.get("decided") and '
             'is_failure_of(err, ex):\n'),
        new='            elif False:\n',
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_in_the_write_back_after_the_"
               "commit_is_reported_as_a_failed_one",),
        hazard="a Ctrl-C in the synchronous write-back leaves a partly averaged replica "
               "that torchft takes for a whole one"),
    Mutant(
        name="r179:ctrl-c-in-wait-keeps-buffer",
        file="pipeoff/ft/_collective.py",
        old=("            # may still write it.\n"
             "            ctx.retire_buffer(dev)\n"),
        new="            # may still write it.\n            pass\n",
        tests=("tests/ft/test_local_sgd_cuda.py::test_a_block_a_failed_all_reduce_may_still_"
               "write_is_never_reused",),
        hazard="a Ctrl-C in an all-reduce's wait hands its staging block to the next user "
               "while the collective may still write it"),
    Mutant(
        name="r180:retired-block-freed-at-once",
        file="pipeoff/staging.py",
        old=("            if block.ready is None:\n"
             "                self._reserved -= block.capacity\n"),
        new="            if True:\n                self._reserved -= block.capacity\n",
        tests=("tests/test_cuda_waits.py::test_a_retired_block_is_freed_only_once_its_last_"
               "user_has_run",),
        hazard="a retired staging block freed while its last user's stream still reads it: "
               "the allocator hands the memory to the next allocation"),
    Mutant(
        name="r181:scheduler-on-inner-not-told",
        file="pipeoff/optim/_offloaded.py",
        old="    _compat.note_step_called(inner)\n",
        new="",
        tests=("tests/optim/test_optim_errors.py::test_a_scheduler_built_on_the_wrapped_"
               "optimizer_sees_its_steps",),
        hazard="a scheduler built on the wrapped optimizer warns that the loop stepped it "
               "in the wrong order"),
    Mutant(
        name="r182:backward-on-stale-weights-taken",
        file="pipeoff/optim/_full_offload/_intake.py",
        old="        if health.stale is not None and health.dirty is None:\n",
        new="        if False:\n",
        tests=("tests/optim/test_full_offload.py::test_a_backward_on_stale_weights_steps_"
               "nothing",),
        hazard="gradients of stale device weights step the masters (overlap='backward': "
               "during the backward; else after refresh_device_weights())"),
    Mutant(
        name="r183:ctrl-c-after-commit-masters-kept",
        file="pipeoff/ft/_local_sgd.py",
        old="                    self._adopt_average()  # (as a sync that returned would)\n",
        new="                    pass\n",
        tests=("tests/ft/test_peer_failed.py::test_ctrl_c_in_a_pipelined_local_sgd_sync_is_"
               "passed_on_once_the_sync_has_ended",),
        hazard="a Ctrl-C passed on after a committed sync leaves FullOffloadOptimizer's "
               "masters un-averaged: the next step undoes the average"),
    Mutant(
        name="r184:bucket-skipped-before-entry-unseen",
        file="pipeoff/ft/_collective.py",
        old="    if index != link.entered:\n",
        new="    if False:\n",
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_before_a_bucket_reaches_its_"
               "all_reduce_skips_the_later_ones",),
        hazard="a Ctrl-C before a bucket's task reached its all-reduce: the later ones join "
               "one behind the peer's (gloo aborts the process)"),
    Mutant(
        name="r185:half-step-said-stale",
        file="pipeoff/optim/_full_offload/_fraction.py",
        old="        self.device_part = bool(self.part.params)\n",
        new="        self.device_part = False\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_failed_copy_after_a_final_"
               "backward_with_a_device_part_is_a_torn_step",),
        hazard="host chunks stepped, the device part not: said stale, the loop refreshes the "
               "weights and trains on from half a step"),
    Mutant(
        name="r186:last-bucket-skipped-vote-joins",
        file="pipeoff/ft/_collective.py",
        old="    if link.broken or link.entered != link.buckets:\n",
        new="    if link.broken:\n",
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_before_a_bucket_reaches_its_"
               "all_reduce_skips_the_later_ones",),
        hazard="the last bucket never reached its all-reduce: the vote meets the peer's last "
               "bucket (gloo aborts, or sums the vote into a parameter)"),
    Mutant(
        name="r187:adopt-refusal-replaces-ctrl-c",
        file="pipeoff/ft/_local_sgd.py",
        old=("                    except Exception as refused:  "
             "# (the Ctrl-C stays what is raised)\n"),
        new="                    except ZeroDivisionError as refused:\n",
        tests=("tests/ft/test_peer_failed.py::test_ctrl_c_in_a_pipelined_local_sgd_sync_is_"
               "passed_on_once_the_sync_has_ended",),
        hazard="the masters refuse the average after a Ctrl-C the sync ran past: the refusal "
               "is raised, not the Ctrl-C"),
    Mutant(
        name="r188:wait-before-the-clock",
        file="pipeoff/optim/full_offload.py",
        old=("                self._emit_stats()  "
             "# the last step's figures, now that it has finished\n"),
        new="                self._emit_stats()\n                start = time.perf_counter_ns()\n",
        tests=("tests/test_trace_train.py::test_a_steps_wait_for_the_one_before_is_exposed_"
               "time_with_a_hook_too",),
        hazard="with a stats hook, the wait for the step before is outside exposed_ms (it "
               "read 0.4 of step()'s wall time)"),
    Mutant(
        name="r189:ctrl-c-before-decision-zeros",
        file="pipeoff/ft/_diloco_fragment.py",
        old="                self._join_all_reduces(ex)\n                ex.gate(\"commit\").fail(",
        new="                ex.gate(\"commit\").fail(",
        tests=("tests/ft/test_diloco_interrupts.py::test_a_ctrl_c_before_the_decision_joins_"
               "every_bucket_as_formed",),
        hazard="a Ctrl-C before DiLoCo's decision: the buckets not yet formed go in as zeros "
               "and the peer commits that average"),
    Mutant(
        name="r190:merge-restored-after-commit",
        file="pipeoff/ft/_diloco_fragment.py",
        old="            deciding = False  # (a failure from here on is after the decision)\n",
        new="",
        tests=("tests/ft/test_diloco_interrupts.py::test_a_ctrl_c_after_the_commit_keeps_the_"
               "merge_and_says_so",),
        hazard="a Ctrl-C after DiLoCo's commit restores the backup over the merge, silently"),
    Mutant(
        name="r191:stale-weights-adopted",
        file="pipeoff/optim/_full_offload/_model_sync.py",
        old="        if health.stale is None:\n            return False\n",
        new="        if True:\n            return False\n",
        tests=("tests/optim/test_full_offload.py::test_weights_written_while_stale_are_neither_"
               "adopted_nor_overwritten",),
        hazard="weights written while stale: adopted as masters (the step they missed lost) or "
               "overwritten by refresh_device_weights() (the write lost)"),
    Mutant(
        name="r192:final-folds-after-failed-micro-step",
        file="pipeoff/optim/_full_offload/_launcher.py",
        old="            if failed is not None:\n",
        new="            if False:\n",
        tests=("tests/optim/test_full_offload.py::test_a_failed_earlier_micro_step_under_"
               "overlap_backward_steps_nothing",),
        hazard="a micro-step launched after an earlier one of its step failed folds and, under "
               "overlap='backward', steps on the later gradients alone (a torn step)"),
    Mutant(
        name="r193:vote-failure-replaces-cause",
        file="pipeoff/ft/_collective.py",
        old="    if manager.errored() is not None:\n        # (Rejected already,",
        new="    if False:\n        # (Rejected already,",
        tests=("tests/ft/test_failed_joins.py::test_a_ctrl_c_before_a_bucket_reaches_its_"
               "all_reduce_skips_the_later_ones",),
        hazard="the vote's failure reported over the first cause (a dead peer's all-reduce "
               "error): manager.errored() no longer says what happened"),
    Mutant(
        name="r194:hook-time-exposed",
        file="pipeoff/optim/_offloaded.py",
        old="        return time.perf_counter_ns() - start - (self._stats_hook_ns - hooks)\n",
        new="        return time.perf_counter_ns() - start\n",
        tests=("tests/test_trace_train.py::test_the_stats_hooks_own_time_is_not_exposed_time",),
        hazard="a stats hook's own time (a logger) counted as the step's exposed time"),
    Mutant(
        name="r195:second-ctrl-c-in-join-votes",
        file="pipeoff/ft/_diloco_fragment.py",
        old="                self._link.broken = True\n",
        new="                pass\n",
        tests=("tests/ft/test_diloco_interrupts.py::test_a_second_ctrl_c_in_the_join_skips_the_"
               "vote_and_the_peer_rejects",),
        hazard="a second Ctrl-C in the join of the all-reduces: the buckets not yet formed go in "
               "as zeros, the vote says all is well, the peer commits them"),
    Mutant(
        name="r196:load-takes-written-weight-at-once",
        file="pipeoff/optim/_full_offload/_surface.py",
        old="            if i in keep:\n",
        new="            if i in keep:\n                rec.master_from_weight()\n",
        tests=("tests/optim/test_full_offload.py::test_a_checkpoint_loaded_after_a_clamp_resumes_"
               "bitwise_in_either_order",),
        hazard="a clamp, then a checkpoint loaded optimizer first: the clamped weight is the "
               "master, and the model's weights adopted next lose the FP32 bits"),
    Mutant(
        name="r197:ctrl-c-hides-a-failed-write",
        file="pipeoff/ft/_diloco_fragment.py",
        old="            self._manager.report_error(reportable(failure, \"DiLoCo's sync after its "
            "decision\"))\n",
        new="",
        tests=("tests/ft/test_diloco_interrupts.py::test_a_write_that_fails_after_a_ctrl_c_after_"
               "the_commit_is_reported",),
        hazard="a write fails while a Ctrl-C waits for it after the commit: torchft is not "
               "told, and the partly written replica commits its next sync"),
    Mutant(
        name="r198:sim-copies-a-0-dim-copy-target",
        file="pipeoff/testing/_simops.py",
        old="            and func.overloadpacket not in COPIES)\n",
        new="            )\n",
        tests=("tests/test_simcuda.py::test_a_copy_of_a_0_dim_host_tensor_is_a_copy",),
        hazard="the simulated device writes a copy into a 0-dim pinned tensor into a copy of "
               "it: a scalar parameter steps wrongly there, never on a GPU"),
    Mutant(
        name="r199:sim-device-like-is-host",
        file="pipeoff/testing/_simcuda.py",
        old="                    and \"device\" not in kwargs)",
        new="                    and True)",
        tests=("tests/test_simcuda.py::test_a_like_with_device_is_device_memory",),
        hazard="empty_like(x, device=dev) of a host tensor is host memory on the simulated "
               "device: single_pass's step runs on host copies, its device path unchecked"),
    Mutant(
        name="r200:0-dim-bytes-view",
        file="pipeoff/optim/_tensors.py",
        old="        cast.cpu().reshape(-1).view(torch.uint8),\n",
        new="        cast.cpu().view(torch.uint8),\n",
        tests=("tests/optim/test_full_offload_fraction.py::test_a_0_dim_parameter_written_"
               "from_outside_and_loaded_has_the_bits_of_fraction_1",),
        hazard="a 0-dim weight in the device part written from outside, or loaded: the "
               "next step raises torch's RuntimeError"),
    Mutant(
        name="r201:diloco-ctrl-c-counted-commit-unsaid",
        file="pipeoff/ft/_diloco_fragment.py",
        old="interrupted_note(\"in\", manager.current_step() > asked_at)",
        new="interrupted_note(\"in\", False)",
        tests=("tests/ft/test_diloco_interrupts.py::test_a_ctrl_c_in_should_commit_after_"
               "torchft_counted_the_commit_says_so",),
        hazard="a Ctrl-C in should_commit() after torchft counted the commit: the replica, "
               "restored from its backup, is out of step with its peers and told it holds "
               "the global model"),
    Mutant(
        name="r202:sim-launch-read-unchecked",
        file="pipeoff/testing/_simcuda.py",
        old="                self.host_read(t, str(func))  # the host reads a scalar argument "
            "now\n",
        new="                pass\n",
        tests=("tests/test_simcuda.py::test_an_in_place_kernels_scalar_argument_is_read_at_"
               "its_launch",),
        hazard="an in-place kernel reading a 0-dim pinned tensor a pending D2H writes: the "
               "simulated device misses the race, and computes with the stale value"),
)

MUTANTS: tuple[Mutant, ...] = (*SWITCHES, *REVIEW, *SPECULATIVE)
"""Every mutant, in the order ``run.py`` runs and prints them."""

"""How pyddp's results in torch's distributed suite may differ from gloo's, and why.

``run.py`` runs every test of ``DistributedTest._DistTestBase``
(``torch/testing/_internal/distributed/distributed_test.py``, shipped in the
torch wheel; torch's own ``TestDistBackendWithSpawn`` runs the same class)
on gloo and on the ``"pyddp"`` backend. A test that passes with gloo must pass
with pyddp, unless ``DIFFERENCES`` lists it. The tests that torch skips for
pyddp by the backend's name run a second time with those skips lifted; each
must pass unless ``LIFTED_FAILURES`` says why not. This module is plain data,
so that ``tests/torch_compat/test_torch_suite.py`` can check it against torch's file
without importing torch's suite.
"""

WORLD_SIZE = 2
"""Ranks per test, as torch's CI runs the class for gloo."""

_GATED = "torch's suite runs it for gloo only (a check of the backend's name); its body uses " \
         "only torch.distributed calls, and it runs with the check lifted in the second report"
_ONE_OF = "Test requires backend pyddp to be one of"

DIFFERENCES = {
    # test: (pyddp's outcome, why, a text of torch's skip reason or of the failure)
    "test_barrier_timeout_full_group": ("skipped", _GATED, "Only gloo backend supports timeouts"),
    "test_batch_isend_irecv_gloo": ("skipped", _GATED, "GLOO Batch Send Recv CPU"),
    "test_batch_isend_irecv_gloo_tags": ("skipped", _GATED, "GLOO Batch Send Recv CPU"),
    "test_sparse_all_reduce_sum": ("skipped", _GATED,
                                   "Only Gloo backend supports sparse all reduce"),
    "test_all_reduce_coalesced_sum": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_product": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_min": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_max": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_full_group_sum": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_full_group_product": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_full_group_min": ("skipped", _GATED, _ONE_OF),
    "test_all_reduce_coalesced_full_group_max": ("skipped", _GATED, _ONE_OF),
    "test_accumulate_gradients_no_sync": ("skipped", _GATED,
                                          "get_future is only supported on mpi, nccl and gloo"),
    "test_accumulate_gradients_no_sync_grad_is_view": (
        "skipped", _GATED, "get_future is only supported on mpi, nccl and gloo"),
    "test_accumulate_gradients_no_sync_allreduce_hook": (
        "skipped", _GATED, "get_future is only supported on mpi, nccl and gloo"),
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": (
        "skipped", _GATED, "get_future is only supported on mpi, nccl and gloo"),
    "test_get_future": ("skipped", _GATED, "get_future is only supported on mpi, nccl and gloo"),
    "test_all_gather_object_default_pg": ("skipped", _GATED, _ONE_OF),
    "test_all_gather_object_subgroup": ("skipped", _GATED, _ONE_OF),
    "test_grads_same_across_ranks_with_no_sync": ("skipped", _GATED, _ONE_OF),
    "test_scatter_object_list": ("skipped", _GATED, _ONE_OF),
    "test_monitored_barrier_gloo": ("skipped", _GATED, _ONE_OF),
    "test_monitored_barrier_gloo_subgroup": ("skipped", _GATED, _ONE_OF),
    "test_monitored_barrier_gloo_rank_0_timeout": ("skipped", _GATED, _ONE_OF),
    "test_ddp_logging_data_cpu": (
        "failed",
        "torch reports every registered backend as 'custom' in DDP's logging data "
        "(c10d::Logger reads ProcessGroup::getBackendName(), the name of the group's "
        "BackendType, CUSTOM, not the backend's own 'pyddp'): needs a change in torch",
        "'custom' != 'pyddp'"),
}
"""Tests gloo passes and pyddp does not, with pyddp's outcome and why."""

_NO_MODEL = (
    "the test's body makes its DDP model only for the backends it names (mpi, gloo, nccl), "
    "so with any other backend it fails before reaching pyddp",
    "cannot access local variable 'ddp_model'")
_MONITORED = (
    "torch.distributed.monitored_barrier refuses every backend but gloo in torch's Python "
    "(distributed_c10d.py), before any backend is asked",
    "monitored_barrier is only implemented for GLOO backend")

LIFTED_FAILURES = {
    "test_accumulate_gradients_no_sync": _NO_MODEL,
    "test_accumulate_gradients_no_sync_grad_is_view": _NO_MODEL,
    "test_accumulate_gradients_no_sync_allreduce_hook": _NO_MODEL,
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _NO_MODEL,
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
}
"""Tests torch skips for pyddp by name that fail when the skip is lifted: test -> (why, a text
the failure must contain)."""

"""Which tests of torch's distributed suite run against pyddp, and what is expected of them.

The tests are methods of ``DistributedTest._DistTestBase`` in
``torch/testing/_internal/distributed/distributed_test.py`` (shipped in the
torch wheel). ``run.py`` runs ``TESTS`` on the ``"pyddp"`` backend and on gloo,
the baseline. This module is plain data, so that ``tests/test_torch_suite.py``
can check it against torch's file without importing torch's suite.

The list covers what pyddp claims to serve through ``torch.distributed`` and
what it does not serve yet. Tests that need CUDA, MPI or NCCL are left out:
they skip on both backends of a CPU machine and say nothing about pyddp.
"""

WORLD_SIZE = 3
"""Ranks per test: odd, so rings and blocks are uneven, and enough for a subgroup that
leaves a rank out. (torch gates its ``*_group`` tests on 8 ranks, too many for 2 cores.)"""

NOT_IMPLEMENTED_YET: dict = {}
"""Operations pyddp does not implement, each with the c10d entry points it is refused at.

A test that needs one runs on pyddp and must fail with pyddp's refusal of one of those
entry points ("... (c10d's send): ..."). When an operation lands, delete its line here: its
tests are then expected to pass. The driver fails on a test that passes while its operation
is still listed, naming the line to delete.
"""

# Every test, by the part of torch.distributed it covers. A test name maps to
# the operation of NOT_IMPLEMENTED_YET it needs, or None.
TESTS = {
    # Ranks, backend names and groups over all ranks or some (new_group,
    # destroy_process_group, get_rank/get_world_size of a group).
    "groups": {
        "test_get_rank": None,
        "test_get_backend": None,
        "test_Backend_enum_class": None,
        "test_destroy_group": None,
        "test_destroy_full_group": None,
        "test_get_rank_size_group": None,
        "test_get_rank_size_full_group": None,
    },
    # Every collective pyddp serves, on the default group and on a group of
    # all ranks made with new_group; complex tensors (torch passes them as
    # real views).
    "collectives": {
        "test_broadcast": None,
        "test_broadcast_full_group": None,
        "test_reduce_sum": None,
        "test_reduce_product": None,
        "test_reduce_min": None,
        "test_reduce_max": None,
        "test_reduce_sum_twice": None,
        "test_reduce_full_group_sum": None,
        "test_reduce_full_group_product": None,
        "test_reduce_full_group_min": None,
        "test_reduce_full_group_max": None,
        "test_all_reduce_sum": None,
        "test_all_reduce_product": None,
        "test_all_reduce_min": None,
        "test_all_reduce_max": None,
        "test_all_reduce_sum_complex": None,
        "test_sparse_all_reduce_sum": None,
        "test_all_reduce_full_group_sum": None,
        "test_all_reduce_full_group_product": None,
        "test_all_reduce_full_group_min": None,
        "test_all_reduce_full_group_max": None,
        "test_scatter": None,
        "test_scatter_complex": None,
        "test_scatter_full_group": None,
        "test_gather": None,
        "test_gather_full_group": None,
        "test_all_gather": None,
        "test_all_gather_complex": None,
        "test_all_gather_full_group": None,
        "test_barrier": None,
        "test_barrier_full_group": None,
    },
    # Asynchronous work: Work.wait and Work.get_future chains.
    "async work": {
        "test_all_reduce_sum_async": None,
        "test_get_future": None,
    },
    # Object collectives (pickles moved by all_gather, gather, scatter,
    # broadcast), also on a subgroup that leaves a rank out.
    "object collectives": {
        "test_all_gather_object_default_pg": None,
        "test_all_gather_object_subgroup": None,
        "test_scatter_object_list": None,
    },
    # torch's DistributedDataParallel over the backend.
    "DDP": {
        "test_DistributedDataParallelCPU": None,
        "test_DistributedDataParallelCPU_grad_is_view": None,
        "test_DistributedDataParallel_requires_grad": None,
        "test_ddp_create_graph": None,
        "test_static_graph_api_cpu": None,
        "test_grads_same_across_ranks_with_no_sync": None,
        "test_ddp_logging_data_cpu": None,
    },
    # Errors: argument checks raise on the caller, a barrier that a rank
    # never joins times out with the group's timeout.
    "error handling": {
        "test_scatter_checks": None,
        "test_gather_checks": None,
        "test_all_reduce_complex_unsupported_ops": None,
        "test_all_reduce_coalesced_max_complex_unsupported": None,
        "test_barrier_timeout_full_group": None,
        "test_monitored_barrier_gloo": None,
    },
    # Point-to-point.
    "send/recv": {
        "test_send_recv": None,
        "test_send_recv_any_source": None,
        "test_send_recv_with_tag": None,
        "test_send_recv_autograd_profiler": None,
        "test_isend": None,
        "test_irecv": None,
        "test_batch_isend_irecv_gloo": None,
    },
    # (test_all_to_all, the list form, is left out: gloo fails it at 3 ranks,
    # taking equal sizes only.)
    "all_to_all": {
        "test_all_to_all_single_equal_split": None,
        "test_all_to_all_single_unequal_split": None,
    },
    "coalesced collectives": {
        "test_all_reduce_coalesced_sum": None,
        "test_all_reduce_coalesced_max": None,
        "test_all_reduce_coalesced_full_group_sum": None,
        "test_all_gather_coalesced_simple": None,
        "test_all_gather_coalesced_with_empty": None,
        "test_all_gather_coalesced_full_group": None,
    },
}

LIFTED_GATES = {
    "test_get_future": "get_future is only supported on mpi, nccl and gloo",
    "test_all_gather_object_default_pg": "Test requires backend pyddp to be one of",
    "test_all_gather_object_subgroup": "Test requires backend pyddp to be one of",
    "test_scatter_object_list": "Test requires backend pyddp to be one of",
    "test_grads_same_across_ranks_with_no_sync": "Test requires backend pyddp to be one of",
    "test_barrier_timeout_full_group": "Only gloo backend supports timeouts",
    "test_sparse_all_reduce_sum": "Only Gloo backend supports sparse all reduce",
    "test_monitored_barrier_gloo": "Test requires backend pyddp to be one of",
    "test_batch_isend_irecv_gloo": "GLOO Batch Send Recv CPU",
    "test_all_to_all_single_equal_split": "Only MPI supports CPU all_to_all_single",
    "test_all_to_all_single_unequal_split": "Only MPI supports CPU all_to_all_single",
    "test_all_reduce_coalesced_sum": "Test requires backend pyddp to be one of",
    "test_all_reduce_coalesced_max": "Test requires backend pyddp to be one of",
    "test_all_reduce_coalesced_full_group_sum": "Test requires backend pyddp to be one of",
}
"""Skips that torch decides by the backend's name, lifted because the test's body uses only
calls of torch.distributed (that a drop-in must serve), not a gloo-, MPI- or NCCL-specific API.

The value is the start of the reason torch gives; the driver lifts a skip only when its
reason starts so, and reports any other skip as torch gives it (a GPU count, say).
"""

KNOWN_FAILURES = {
    "test_ddp_logging_data_cpu": (
        "torch reports every registered backend as 'custom' in DDP's logging data "
        "(c10d::Logger reads ProcessGroup::getBackendName(), the name of the group's "
        "BackendType, CUSTOM, not the backend's own 'pyddp'): needs a change in torch",
        "'custom' != 'pyddp'"),
    "test_monitored_barrier_gloo": (
        "torch.distributed.monitored_barrier refuses every backend but gloo in Python "
        "(distributed_c10d.py), before any backend is asked",
        "monitored_barrier is only implemented for GLOO backend"),
}
"""pyddp's failures that no pending operation explains: test -> (reason, a text the failure
must contain). An unexpected pass fails the run, so that this list stays true."""

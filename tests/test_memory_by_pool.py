"""memory_by_pool: the CUDA allocator's snapshot summed by pool (default against the CUDA graphs'
private pools), on segment records shaped as ``torch.cuda.memory_snapshot()`` gives them; its GPU
use is checked in test_fp8's packed-graph case."""
from bertqa_bench.backends.device_io import memory_by_pool

MIB = 2**20


def _segment(pool, total, blocks):
    return {"segment_pool_id": pool, "total_size": total * MIB,
            "allocated_size": sum(size for size, state in blocks if state == "active_allocated") * MIB,
            "blocks": [{"size": size * MIB, "state": state} for size, state in blocks]}


def test_memory_is_summed_by_pool_and_only_allocated_blocks_count():
    segments = [
        _segment((0, 0), 1024, [(512, "active_allocated"), (256, "active_allocated"), (256, "inactive")]),
        _segment((1, 0), 600, [(256, "active_allocated"), (256, "active_allocated"), (88, "inactive")]),
        _segment((2, 0), 300, [(256, "active_allocated"), (44, "active_pending_free")]),
    ]
    m = memory_by_pool(segments)
    assert m["cuda_default_pool_mib"] == 768.0
    assert m["cuda_graph_pools"] == 2 and m["cuda_graph_pools_mib"] == 768.0
    assert m["cuda_graph_pools_reserved_mib"] == 900.0
    assert m["cuda_default_largest_blocks_mib"] == "512.0 x 1, 256.0 x 1"
    assert m["cuda_graph_largest_blocks_mib"] == "256.0 x 3"  # the two pools' blocks together


def test_no_graphs_and_no_segments_give_zeros_not_errors():
    assert memory_by_pool([]) == {"cuda_default_pool_mib": 0.0, "cuda_graph_pools": 0, "cuda_graph_pools_mib": 0.0,
                                  "cuda_graph_pools_reserved_mib": 0.0, "cuda_default_largest_blocks_mib": "",
                                  "cuda_graph_largest_blocks_mib": ""}
    only_default = memory_by_pool([_segment((0, 0), 64, [(64, "active_allocated")])])
    assert only_default["cuda_graph_pools"] == 0 and only_default["cuda_default_pool_mib"] == 64.0


def test_the_largest_block_sizes_are_cut_to_top():
    blocks = [(s, "active_allocated") for s in (1, 2, 3, 4, 5, 6, 7, 8)]
    m = memory_by_pool([_segment((0, 0), 64, blocks)], top=3)
    assert m["cuda_default_largest_blocks_mib"] == "8.0 x 1, 7.0 x 1, 6.0 x 1"


def test_only_the_asked_devices_segments_count():
    segments = [dict(_segment((0, 0), 64, [(64, "active_allocated")]), device=0),
                dict(_segment((0, 0), 32, [(32, "active_allocated")]), device=1)]
    assert memory_by_pool(segments, device=1)["cuda_default_pool_mib"] == 32.0
    assert memory_by_pool(segments)["cuda_default_pool_mib"] == 96.0

"""First-fit GPU packing of resource groups."""

from __future__ import annotations

import pytest

from colocate.resources.packing import Inventory, ResourceError, ResourceRequest


def test_four_four_gpu_groups_fill_two_eight_gpu_hosts():
    inventory = Inventory(num_hosts=2, gpus_per_host=8)
    placed = [inventory.place(ResourceRequest(f"g{i}", hosts=1, procs_per_host=4))
              for i in range(4)]
    assert [(p.hosts, p.gpus) for p in placed] == [
        ((0,), ((0, 1, 2, 3),)), ((0,), ((4, 5, 6, 7),)),
        ((1,), ((0, 1, 2, 3),)), ((1,), ((4, 5, 6, 7),)),
    ]
    assert inventory.free() == {0: [], 1: []}


def test_no_gpu_is_given_to_two_groups():
    inventory = Inventory(num_hosts=2, gpus_per_host=8)
    inventory.place(ResourceRequest("trainer", hosts=2, procs_per_host=3))
    inventory.place(ResourceRequest("gen", hosts=1, procs_per_host=5))
    inventory.place(ResourceRequest("ref", hosts=1, procs_per_host=5))
    owners = inventory.owner
    assert len(owners) == 16  # every GPU taken exactly once
    assert sorted(g for (h, g), o in owners.items() if o == "gen") == [3, 4, 5, 6, 7]
    assert [(h, g) for (h, g), o in owners.items() if o == "ref"] == \
        [(1, g) for g in range(3, 8)]


def test_a_request_that_does_not_fit_fails_listing_what_is_free():
    inventory = Inventory(num_hosts=2, gpus_per_host=8)
    inventory.place(ResourceRequest("a", hosts=1, procs_per_host=6))
    inventory.place(ResourceRequest("b", hosts=1, procs_per_host=6))
    with pytest.raises(ResourceError, match=r"host 0: 2 free \[6, 7\], host 1: 2 free \[6, 7\]"):
        inventory.place(ResourceRequest("c", hosts=1, procs_per_host=4))
    assert "c" not in inventory.placements  # nothing was taken
    with pytest.raises(ResourceError, match="3 hosts; there are 2"):
        inventory.place(ResourceRequest("d", hosts=3))
    with pytest.raises(ResourceError, match="9 GPUs per host; a host has 8"):
        inventory.place(ResourceRequest("e", procs_per_host=9))
    inventory.release("a")
    assert inventory.place(ResourceRequest("c", hosts=1, procs_per_host=4)).gpus == ((0, 1, 2, 3),)


def test_bad_requests_name_the_field():
    with pytest.raises(ValueError, match="procs_per_host"):
        ResourceRequest("g", procs_per_host=0)
    with pytest.raises(ValueError, match="hosts"):
        ResourceRequest("g", hosts=0)
    with pytest.raises(ValueError, match="resource_group"):
        ResourceRequest("")
    with pytest.raises(ResourceError, match="not placed"):
        Inventory(1, 1).release("nope")

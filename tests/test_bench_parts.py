"""bench/switch_parts.py times the runtime's own functions by name: each one it names is
there, and a name that is not fails loudly instead of timing nothing."""

import pytest

from bench.switch_parts import ARBITER, CLIENT, TENANT, find


@pytest.mark.parametrize(("module_name", "qualname"), TENANT + ARBITER + CLIENT)
def test_every_part_the_bench_times_is_there(module_name, qualname):
    owner, attr = find(module_name, qualname)
    assert callable(getattr(owner, attr))


def test_a_part_that_moved_fails_the_bench_naming_it():
    with pytest.raises(AttributeError, match="colocate.resources.switching.Switchboard.gone"):
        find("colocate.resources.switching", "Switchboard.gone")

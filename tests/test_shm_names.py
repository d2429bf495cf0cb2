"""Segment names are built and parsed in one module: what it builds, it parses back, and nothing else."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmtransport import shm_names

prefixes = st.from_regex(r"[A-Za-z0-9_.]{1,32}", fullmatch=True)
instances = st.from_regex(r"[0-9a-f]{12}", fullmatch=True)
tenants = st.integers(0, 1000)
generations = st.integers(1, 2**63)


@given(prefixes, instances, tenants, generations)
def test_a_dedicated_name_parses_back_to_its_tenant_and_generation(prefix, instance, tenant, generation):
    base = shm_names.tenant_base(prefix, instance, tenant)
    arena = shm_names.arena_name(base)
    name = shm_names.dedicated_name(base, generation)
    assert shm_names.base_of_arena(arena) == base
    assert shm_names.dedicated_generation(base, name) == generation
    assert shm_names.is_dedicated_of_arena(arena, name)
    assert shm_names.of_some_instance(prefix, name) and shm_names.is_dedicated_of_some_instance(prefix, name)
    assert not shm_names.names_another_tenant(base, name)
    for own in (arena, shm_names.table_name(base)):
        assert shm_names.dedicated_generation(base, own) is None
        assert shm_names.of_some_instance(prefix, own) and not shm_names.is_dedicated_of_some_instance(prefix, own)


@given(prefixes, instances, tenants, generations)
def test_another_tenants_files_are_named_as_such_and_never_as_ours(prefix, instance, tenant, generation):
    ours, theirs = (shm_names.tenant_base(prefix, instance, t) for t in (tenant, tenant + 1))
    for name in (shm_names.arena_name(theirs), shm_names.dedicated_name(theirs, generation)):
        assert shm_names.names_another_tenant(ours, name)
        assert shm_names.dedicated_generation(ours, name) is None
        assert not shm_names.is_dedicated_of_arena(shm_names.arena_name(ours), name)


@pytest.mark.parametrize("name", ["", "x" * 33, "a-b", "a/b", "a b"])
def test_a_prefix_outside_the_rule_is_refused(name):
    with pytest.raises(ValueError, match="name prefix must match"):
        shm_names.validate_prefix(name)


def test_planted_look_alikes_are_not_dedicated_segments():
    base = shm_names.tenant_base("shmt", "0123456789ab", 0)
    for planted in (f"{base}-obj1", f"{base}-obj-1-ab", f"{base}-objx-ab", f"{base}-obj1-XY", f"{base}x-obj1-ab"):
        assert shm_names.dedicated_generation(base, planted) is None, planted
    with pytest.raises(ValueError, match="not an arena name"):
        shm_names.base_of_arena(shm_names.table_name(base))

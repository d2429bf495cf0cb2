"""Names in /dev/shm: every daemon segment name is built and parsed here, nowhere else.

A daemon instance names its segments ``{prefix}-{instance}-t{tenant}-{kind}``: ``arena``,
``objects`` and ``holds`` (the object table's two segments; these three are memfds, their names
seen only in ``/proc/*/fd``) and ``obj{generation}-{random}`` (a dedicated segment, a file in
/dev/shm). ``instance`` is 12 hex digits, new at every start, so a later daemon tells a dead
instance's leftovers from its own.
"""
from __future__ import annotations

import os
import re
import secrets

SHM_DIR = "/dev/shm"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.]{1,32}$")
_INSTANCE_HEX = 12


def validate_prefix(prefix: str) -> str:
    """``prefix`` when it is a valid name prefix; ValueError naming the rule otherwise."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"name prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
    return prefix


def new_instance_id() -> str:
    """A fresh random instance id: 12 lowercase hex digits."""
    return secrets.token_hex(_INSTANCE_HEX // 2)


def tenant_base(prefix: str, instance_id: str, tenant_index: int) -> str:
    """The part every file of one tenant of one daemon instance starts with."""
    return f"{prefix}-{instance_id}-t{tenant_index}"


def arena_name(base: str) -> str:
    """The name of the arena segment of ``base`` (``{prefix}-{instance}-t{tenant}``)."""
    return f"{base}-arena"


def table_name(base: str) -> str:
    """The name of the object-table segment of ``base`` (``{prefix}-{instance}-t{tenant}``)."""
    return f"{base}-objects"


def holds_name(base: str) -> str:
    """The object table's holds (``objtable``): the one segment a consumer maps writable."""
    return f"{base}-holds"


def dedicated_name(base: str, generation: int) -> str:
    """A dedicated segment's name; the random tail keeps a planted file from guessing it."""
    return f"{base}-obj{generation}-{secrets.token_hex(4)}"


def base_of_arena(arena: str) -> str:
    """The tenant base of an arena name (``arena_name``'s inverse)."""
    base, kind = arena.rsplit("-", 1)
    if kind != "arena":
        raise ValueError(f"not an arena name: {arena!r}")
    return base


def dedicated_generation(base: str, name: str) -> int | None:
    """The generation of ``name`` when it is a dedicated segment of the tenant ``base``, else None."""
    match = re.fullmatch(rf"{re.escape(base)}-obj([0-9]+)-[0-9a-f]+", name)
    return int(match.group(1)) if match else None


def is_dedicated_of_arena(arena: str, name: str) -> bool:
    """Whether ``name`` is a dedicated segment of the tenant whose arena is ``arena``."""
    return dedicated_generation(base_of_arena(arena), name) is not None


def names_another_tenant(base: str, name: str) -> bool:
    """Whether ``name`` is a file of another tenant of the same daemon instance as ``base``."""
    instance_base = base.rsplit("-", 1)[0]
    return re.match(rf"{re.escape(instance_base)}-t[0-9]+-", name) is not None \
        and not name.startswith(base + "-")


def of_some_instance(prefix: str, name: str) -> bool:
    """Whether ``name`` is a file of some daemon instance with this ``prefix`` (a sweep candidate)."""
    return re.match(rf"{re.escape(prefix)}-[0-9a-f]{{{_INSTANCE_HEX}}}-", name) is not None


def is_dedicated_of_some_instance(prefix: str, name: str) -> bool:
    """Whether ``name`` is a dedicated segment of any instance using ``prefix``."""
    return re.fullmatch(rf"{re.escape(prefix)}-[0-9a-f]{{{_INSTANCE_HEX}}}-t[0-9]+-obj[0-9]+-[0-9a-f]+",
                        name) is not None


def shm_namespace_id() -> str:
    """``<boot_id>:<st_dev of /dev/shm>``: two parties with equal ids share the same /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"

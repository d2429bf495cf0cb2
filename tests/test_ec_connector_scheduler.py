"""The scheduler side of ``ShmtransportECConnector`` on a real vLLM config (no engine): look-ups,
holds and their release, items found before held in shared memory with no round trip to the
daemon, and an evicted item asked for again. The engine-level behaviour is tests/test_ec_connector.py."""
from __future__ import annotations

import numpy as np
import pytest

from shmtransport import testing
from shmtransport.client import Consumer, Producer


@pytest.fixture
def scheduler_side(make_daemon, tmp_path):
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from shmtransport.engine import tiny_model
    from shmtransport.engine.ec_connector import ShmtransportECConnector

    daemon = make_daemon(arena_nbytes=16 << 20, cache_nbytes=256 << 10)
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model.build(tmp_path / "model"))),
                        ec_transfer_config=ECTransferConfig(
                            ec_connector="ShmtransportECConnector", ec_role="ec_consumer",
                            ec_connector_module_path="shmtransport.engine.ec_connector",
                            ec_connector_extra_config={"socket": daemon.config.socket_path}))
    connector = ShmtransportECConnector(config, ECConnectorRole.SCHEDULER)
    with Producer(daemon.config.socket_path) as producer, Consumer(daemon.config.socket_path) as consumer:
        yield daemon, connector, producer, consumer
        connector.shutdown()
    for tenant in daemon.tenants:  # drop what the test published (the fixture checks nothing is left)
        tenant.registry.index.budget_nbytes = 0
        tenant.registry.expire()


def _publish(connector, producer, identifier: str, value: int) -> None:
    from shmtransport.engine.ec_connector import identity_of

    handle = producer.put(np.full((64, 128), value, dtype=np.float32))
    producer.publish(handle, identity_of(identifier), scope=connector.scope)
    producer.release(handle)


def test_a_hit_is_held_until_the_step_ends_and_found_again_without_a_round_trip(scheduler_side):
    daemon, connector, producer, consumer = scheduler_side
    assert not connector.has_cache_item("a" * 64)
    _publish(connector, producer, "a" * 64, 1)
    assert connector.has_cache_item("a" * 64)
    assert consumer.stat().index_hits == 1
    held = testing.settle_daemon(daemon, max_leases=1, max_objects=1)
    assert held.live_objects == 1
    connector.build_connector_meta(None)  # no request took it: the hold goes
    assert connector.has_cache_item("a" * 64)  # remembered: acquired in the table, no look-up
    assert consumer.stat().index_hits == 1
    connector.build_connector_meta(None)


def test_an_evicted_item_is_asked_for_again(scheduler_side):
    daemon, connector, producer, consumer = scheduler_side
    _publish(connector, producer, "b" * 64, 2)
    assert connector.has_cache_item("b" * 64)
    connector.build_connector_meta(None)
    for i in range(20):  # 20 x 32 KiB past a 256 KiB budget: "b" goes first
        _publish(connector, producer, f"{i:064x}", i)
    testing.wait_until(lambda: consumer.lookup([("b" * 64).encode()], scope=connector.scope) == [None],
                       timeout_s=10, what="the entry evicted")
    assert not connector.has_cache_item("b" * 64)

"""popart_compiler/runtime/rendezvous.py: waiting for the other processes in torchrun's
agent store, and failing at once when one ended without joining (the agent's store is
a TCPStore served by this test)."""
import datetime
import socket

import pytest
import torch.distributed as dist

from popart_compiler.errors import Error
from popart_compiler.runtime import rendezvous


@pytest.fixture
def agent_store(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=10))
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    yield store


TIMEOUT = datetime.timedelta(seconds=30)


def test_without_torchrun_nothing_waits(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    rendezvous.wait_for_peers(0, 4, TIMEOUT)  # returns at once: init_process_group waits


def test_returns_once_every_peer_is_joining(agent_store):
    agent_store.set("poptorch/0/joining/1", "1")
    rendezvous.wait_for_peers(0, 2, TIMEOUT)
    assert agent_store.check(["poptorch/0/joining/0"])  # this process said it joins


def test_a_peer_that_ended_without_joining_fails_the_wait_naming_it(agent_store):
    agent_store.set("poptorch/0/ended/2", "1")
    agent_store.set("poptorch/0/joining/1", "1")
    with pytest.raises(Error, match="Process 0 of 3 could not join the other processes: "
                                    r"process 2 of 3 ended \(its exit status was not recorded\)"):
        rendezvous.wait_for_peers(0, 3, TIMEOUT)


def test_keys_belong_to_one_attempt_of_the_run(agent_store, monkeypatch):
    agent_store.set("poptorch/0/ended/1", "1")  # the first attempt's peer ended
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    agent_store.set("poptorch/1/joining/1", "1")
    rendezvous.wait_for_peers(0, 2, TIMEOUT)


def test_joined_marks_this_process(monkeypatch):
    monkeypatch.setattr(rendezvous, "_JOINING", [False])
    rendezvous.joined()
    assert rendezvous._JOINING == [True]

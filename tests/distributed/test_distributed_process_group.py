"""Process-group helpers in this process: env parsing, rank queries, world-1 init/teardown."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from verlite import distributed as vdist


def test_queries_without_a_group() -> None:
    assert not vdist.is_initialized()
    assert vdist.get_rank() == 0
    assert vdist.get_world_size() == 1
    vdist.destroy_process_group()  # nothing to tear down: must not raise


def test_find_free_port_is_bindable() -> None:
    port = vdist.find_free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_init_from_env_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT") as info:
        vdist.init_from_env()
    assert "RANK" not in str(info.value).replace("MASTER_PORT", "")
    assert not vdist.is_initialized()


def test_init_rejects_rank_outside_world() -> None:
    with pytest.raises(ValueError, match="rank"):
        vdist.init_process_group(rank=2, world_size=2, master_addr="127.0.0.1", master_port=1)


def test_world_one_group_wraps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    port = vdist.find_free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    vdist.init_from_env()
    try:
        assert vdist.is_initialized()
        assert (vdist.get_rank(), vdist.get_world_size()) == (0, 1)
        model = nn.Linear(3, 2)
        assert vdist.apply_ddp(model) is model
        assert vdist.apply_fsdp(model) is model
        t = torch.tensor([1.0, 2.0])
        assert vdist.all_reduce_mean(t) is t
        assert t.tolist() == [1.0, 2.0]
        assert vdist.all_gather_object("x") == ["x"]
    finally:
        vdist.destroy_process_group()
    assert not vdist.is_initialized()
    vdist.destroy_process_group()  # idempotent


def _listening(port: int) -> set[str]:
    """The local addresses this machine listens on at ``port`` (IPv4 and IPv6, hex as
    /proc/net spells them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_store_of_a_loopback_group_listens_on_loopback_only() -> None:
    """Rank 0's TCP store listens on the group's address alone: torch's own listened on
    every interface (0.0.0.0 and ::), a loopback run's too."""
    port = vdist.find_free_port()
    vdist.init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    try:
        assert _listening(port) == {"0100007F"}  # 127.0.0.1
    finally:
        vdist.destroy_process_group()
    # a host name (MASTER_ADDR may hold one) may resolve elsewhere: torch listens as it does
    port = vdist.find_free_port()
    vdist.init_process_group(rank=0, world_size=1, master_addr="localhost", master_port=port)
    try:
        assert _listening(port)
    finally:
        vdist.destroy_process_group()

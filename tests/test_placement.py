"""The plan's placement promise is checked at bind time: a tp group the plan priced inside a
node must share a host (4 Gloo ranks of the shared pool pretend to sit on two hosts through
``AUTOPAR_HOST_ID``; the hostnames are exchanged over the job as in a real run)."""

from __future__ import annotations

import os
import socket
import warnings

import torch

from autopar.errors import MeshError
from autopar.mesh import Mesh
from autopar.plan import Collective
from autopar.runtime.placement import HOST_ENV, fixing_order, host_id, misplaced
from autopar.runtime.pool import get_pool
from cost.comm import collective_time
from cost.hardware import Cluster
from cost.topology import Topology, nccl_advice

WORLD = 4
TWO_HOSTS = ["a", "a", "b", "b"]  # consecutive ranks per host, as torchrun launches them
TP_REDUCE = Collective(kind="all_reduce", axis="tp", shape=(8, 1024), dtype="float32",
                       bytes=8 * 1024 * 4, direction="fwd", where="fc2")  # fmt: skip


def _bind(rank, groups, hosts, names, force):
    """Bind a (2, 2) DeviceMesh named ``names`` with this rank on ``hosts[rank]``."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime import bind_mesh

    os.environ[HOST_ENV] = hosts[rank]
    try:
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        mesh = Mesh.from_device_mesh(dm)  # the default cluster: tp and dp priced on NVLink
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                bound = bind_mesh(dm, mesh, (TP_REDUCE,), force_placement=force)
            except MeshError as e:
                return "refused", str(e), []
        return "bound", bound, [str(w.message) for w in caught]
    finally:
        del os.environ[HOST_ENV]


def test_tp_spanning_hosts_is_refused_and_the_right_nesting_binds():
    pool = get_pool(WORLD, exact=True)  # init_device_mesh spans the world
    refused = pool.run(_bind, (), [(TWO_HOSTS, ("tp", "dp"), False)] * WORLD)
    assert {what for what, _, _ in refused} == {"refused"}
    message = refused[0][1]
    assert message.startswith("the plan places tp inside a node (priced on nvlink4, 8 GPUs per "
                              "node) but tp group [0, 2] spans hosts (0 on 'a', 2 on 'b') (and "
                              "1 more group); build the DeviceMesh in the order dp=2, tp=2: "
                              "init_device_mesh(device, (2, 2), mesh_dim_names=('dp', 'tp')) "
                              "and describe the cluster as it is (2 hosts of 2 ranks"), message  # fmt: skip
    assert "or set AUTOPAR_FORCE_PLACEMENT=1 to run anyway" in message
    assert all(m == message for _, m, _ in refused)  # every rank says the same
    nested = pool.run(_bind, (), [(TWO_HOSTS, ("dp", "tp"), False)] * WORLD)
    assert nested == [("bound", r, []) for r in range(WORLD)]


def test_a_forced_misplacement_binds_with_its_predicted_cost():
    pool = get_pool(WORLD, exact=True)  # init_device_mesh spans the world
    forced = pool.run(_bind, (), [(TWO_HOSTS, ("tp", "dp"), True)] * WORLD)
    c = Mesh(tp=2).cluster
    extra = (collective_time("all_reduce", TP_REDUCE.bytes, 2, c.inter)
             - collective_time("all_reduce", TP_REDUCE.bytes, 2, c.intra))  # fmt: skip
    for rank, (what, bound, caught) in enumerate(forced):
        assert (what, bound) == ("bound", Mesh.ordered((("tp", 2), ("dp", 2))).rank_of(
            {"tp": rank // 2, "dp": rank % 2}))  # fmt: skip
        assert len(caught) == 1 and "running anyway (AUTOPAR_FORCE_PLACEMENT)" in caught[0]
        assert f"predicted +{extra * 1e3:.3f} ms per step: tp's collectives on ib-ndr-400g " \
               "instead of nvlink4" in caught[0]  # fmt: skip


def test_misplaced_groups_and_the_order_that_fixes_them():
    mesh = Mesh.ordered((("tp", 2), ("dp", 2)))
    layout = torch.arange(4).reshape(2, 2)
    bad = misplaced(mesh, layout, TWO_HOSTS)
    assert [(b.axis, b.ranks, b.hosts) for b in bad] == [("tp", (0, 2), ("a", "b")),
                                                         ("tp", (1, 3), ("a", "b"))]  # fmt: skip
    assert misplaced(mesh, layout, ["a"] * 4) == []
    assert fixing_order(mesh, TWO_HOSTS) == (("dp", 2), ("tp", 2))
    assert fixing_order(Mesh(tp=4), TWO_HOSTS) is None  # tp=4 cannot fit a 2-rank host
    ep = Mesh.ordered((("ep", 2), ("pp", 2)))  # ep is checked too; pp may cross hosts
    assert [b.axis for b in misplaced(ep, layout, TWO_HOSTS)] == ["ep", "ep"]
    assert fixing_order(ep, TWO_HOSTS) == (("pp", 2), ("ep", 2))


def test_the_host_is_the_hostname_unless_injected(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    assert host_id() == socket.gethostname()
    monkeypatch.setenv(HOST_ENV, "node-7")
    assert host_id() == "node-7"


def test_what_to_change_when_no_order_fits():
    from autopar.runtime.placement import _fix

    assert _fix(Mesh(tp=4), TWO_HOSTS).startswith("tp=4 cannot fit on a host of 2 ranks: lower "
                                                  "it to at most 2")  # fmt: skip
    mesh = Mesh.ordered((("dp", 2), ("tp", 2)))
    assert "order tp=2, dp=2" in _fix(mesh, ["a", "b", "a", "b"])  # round-robin: tp outer fits
    assert _fix(mesh, ["a", "b", "b", "a"]).startswith(  # no order keeps tp on one host
        "no order of Mesh(dp=2, tp=2) keeps tp on one host with these hosts; launch so that each "
        "host holds consecutive ranks"
    )


def test_nccl_advice_follows_the_topology():
    two_nodes = Cluster.preset("dgx-h100", nodes=2)
    advice = nccl_advice(Topology(cluster=two_nodes), (("dp", 2), ("tp", 8)))
    assert advice[0] == "NCCL_NVLS_ENABLE=1: tp's all-reduce runs in the NVSwitch (NVLink SHARP " \
        "on nvlink4)"  # fmt: skip
    assert [a.split("=")[0] for a in advice[1:]] == ["NCCL_CROSS_NIC", "NCCL_IB_HCA",
                                                     "NCCL_PXN_DISABLE"]  # fmt: skip
    assert advice[1].startswith("NCCL_CROSS_NIC=0: dp rings stay on their rail")
    tor = nccl_advice(Topology(cluster=two_nodes, rails=False), (("dp", 2), ("tp", 8)))
    assert tor[1] == "NCCL_CROSS_NIC=1: top-of-rack fabric, dp rings may use any NIC"
    a100 = Cluster.preset("dgx-a100")  # NVLink 3: no NVLink SHARP; one node: no fabric
    assert nccl_advice(Topology(cluster=a100), (("tp", 8),)) == ()


def test_the_plan_prints_the_nccl_advice():
    from autopar import autoparallelize
    from autopar.plan import Plan
    from autopar.tools.testing import MLP

    prog = autoparallelize(MLP(), Mesh(tp=4), (torch.randn(8, 16),))
    assert "advice (launch environment; autopar sets none of it): NCCL_NVLS_ENABLE=1: tp's " \
        "all-reduce" in str(prog.plan)  # fmt: skip
    assert Plan.from_json(prog.plan.to_json()) == prog.plan


def test_a_data_parallel_plan_prints_the_advice_of_its_whole_mesh():
    """The dp axis crosses nodes: its plan advises the rail settings the fabric is priced on
    (the sub-mesh's tp plan alone knows only NVLink)."""
    from autopar import autoparallelize
    from autopar.tools.testing import MLP

    mesh = Mesh(Cluster.preset("dgx-h100", nodes=2), dp=2, tp=8)
    prog = autoparallelize(MLP(), mesh, (torch.randn(16, 16),))
    text = str(prog.plan)
    assert "autopar sets none of it): NCCL_CROSS_NIC=0: dp rings stay on their rail" in text
    assert prog.plan.advice == nccl_advice(Topology(cluster=mesh.cluster), mesh.axes)

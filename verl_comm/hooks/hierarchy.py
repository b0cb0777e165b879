"""Which ranks share a host, and the hierarchical collectives of the int8 path (gloo).

``CompressionConfig.hierarchical: auto``: where the hooks' process group covers WORLD
(WORLD, or a worker lane's group over every rank) and spans two or more hosts with the same
number (two or more) of ranks each, every collective the int8 path runs on (the state's,
each worker lane's) gets a :class:`~verl_comm.compression.hier_int8.Hierarchy`: a group per
host and a group per local rank (``torch.distributed.new_subgroups_by_enumeration``, which
every rank of WORLD must call, in the same order: the hook body of the same bucket). A host
is told apart by torchrun's ``GROUP_RANK`` (its node rank; two network namespaces of one
machine share a host name), else by the host name.
"""

from __future__ import annotations

import logging
import os
import socket

import torch.distributed as dist

from verl_comm.compression.collective import ProcessGroupCollective
from verl_comm.compression.hier_int8 import Hierarchy

logger = logging.getLogger("verl_comm.hooks")


def host_key() -> str:
    """This process's host: ``node <GROUP_RANK>`` under torchrun, else the host name."""
    node = os.environ.get("GROUP_RANK")
    return f"node {node}" if node is not None else f"host {socket.gethostname()}"


def host_layout(keys: list[str]) -> list[list[int]] | None:
    """The ranks of each host (in rank order, hosts in order of their first rank) from every
    rank's :func:`host_key`, or None unless there are >= 2 hosts of the same >= 2 ranks."""
    hosts: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        hosts.setdefault(k, []).append(r)
    groups = list(hosts.values())
    sizes = {len(g) for g in groups}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return None
    return groups


def wants(config, method: str) -> bool:
    """Whether the hooks of ``method`` may run the int8 all-reduce of a whole bucket."""
    if config.hierarchical == "off":
        return False
    return method == "int8" or (config.policy == "auto" and method == "lowrank_int8")


def refuse(config, device) -> None:
    """``hierarchical: auto`` runs on CPU buckets with a gloo group of W > 1 only (the hooks'
    worker): refuse it where it cannot apply.

    Raises:
        ValueError: ``hierarchical`` is ``auto`` and the buckets are on ``device`` without
            the gloo worker (CUDA, or in-process collectives).
    """
    if config.hierarchical == "auto":
        raise ValueError(
            "hierarchical='auto': the hierarchical int8 all-reduce runs on CPU buckets over "
            f"a gloo group of W > 1 only, and these buckets are on {device} with "
            "in-process or CUDA collectives; set hierarchical: off (the default)"
        )


def attach(state, coll: ProcessGroupCollective) -> None:
    """Give ``coll`` its :class:`Hierarchy` where the layout allows (see the module
    docstring); the layout is gathered once per state (one ``all_gather_object``). Call on
    every rank at the same point."""
    if coll.hierarchy is not None or state.config.hierarchical == "off":
        return
    if coll.world_size != dist.get_world_size():
        if state._host_layout is None:  # its subgroups would need every rank of WORLD
            state._host_layout = []
            logger.warning(
                "comm hook: hierarchical=auto: the hooks' process group is a subgroup of "
                "%d of WORLD's %d ranks; the int8 all-reduce stays flat",
                coll.world_size,
                dist.get_world_size(),
            )
        return
    if state._host_layout is None:
        keys: list = [None] * coll.world_size
        dist.all_gather_object(keys, host_key(), group=coll.group)
        state._host_layout = host_layout(keys) or []
        hosts = state._host_layout
        if hosts:
            logger.info(
                "comm hook: int8 all-reduce is hierarchical over %d hosts x %d ranks "
                "(CompressionConfig.hierarchical=auto; off: flat)",
                len(hosts),
                len(hosts[0]),
            )
        else:
            logger.warning(
                "comm hook: hierarchical=auto: the %d ranks are not 2 or more hosts of the "
                "same 2 or more ranks (hosts by torchrun's GROUP_RANK, else the host name: "
                "%s); the int8 all-reduce stays flat",
                coll.world_size,
                sorted(set(keys)),
            )
    hosts = state._host_layout
    if not hosts:
        return
    backend = dist.get_backend(coll.group)
    intra, _ = dist.new_subgroups_by_enumeration(hosts, backend=backend)
    local = [[h[i] for h in hosts] for i in range(len(hosts[0]))]
    inter, _ = dist.new_subgroups_by_enumeration(local, backend=backend)
    coll.hierarchy = Hierarchy(ProcessGroupCollective(intra), ProcessGroupCollective(inter))

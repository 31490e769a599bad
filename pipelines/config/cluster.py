"""The Ray cluster (`ray`): the one to join or start, and the cluster a config is written for
(`ray.cluster`, a list of node shapes), which validation plans every actor on (pipelines/config/world.py)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from pipelines.config.base import Section


class NodeGroup(Section):
    count: int = Field(1, ge=1, description="Nodes of this shape.")
    num_cpus: float = Field(ge=0, description="CPUs per node, as Ray counts them (`ray start --num-cpus`).")
    num_gpus: float = Field(0, ge=0, description="GPUs per node.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per node.")
    gpu_memory_gb: Optional[float] = Field(
        None, gt=0, description="Memory of each GPU in GiB, e.g. 80. When set, validation estimates a trainer "
        "rank's memory from the model's config.json (pipelines/runtime/memory.py) and refuses a config that cannot fit."
    )


class RayConfig(Section):
    address: Optional[str] = Field(
        None, description="Ray cluster to join; unset starts a local one for this job (inside a job submitted "
        "with `streamrl submit` or `ray job submit`, the job's own cluster is joined)."
    )
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs of the local cluster; default all.")
    object_store_memory_mb: Optional[int] = Field(
        None, ge=64, description="Object store size of the local cluster in MB; unset: sized from what goes "
        "through it (the policy's weights x the versions in flight, from the model's config.json; "
        "pipelines/runtime/memory.py), at least 512. Checked against the free room in /dev/shm before Ray starts."
    )
    include_dashboard: bool = Field(False, description="Start Ray's dashboard with the local cluster.")
    dashboard_host: str = Field(
        "127.0.0.1", description="Interface the local cluster's dashboard binds to; loopback unless you mean "
        "to expose it (0.0.0.0 lets anyone who reaches this machine submit code)."
    )
    cluster: Optional[list[NodeGroup]] = Field(
        None, description="The cluster this config is written for, e.g. [{count: 2, num_cpus: 96, num_gpus: 8}]. "
        "When set, validation checks that every actor and the trainer placement fit on it."
    )

"""rankwatch.base: the torch-free ground everything stands on — the telemetry schema (`schema`), the run directory
and its files (`rundir`), and the topology nouns (`topology`: layout, hosts, groups, links). It imports nothing else
of rankwatch."""

from rankwatch.base.rundir import RunDir, RunFileError, atomic_write, read_launches
from rankwatch.base.schema import SCHEMA_VERSION, Table
from rankwatch.base.topology import GroupInfo, Hosts, Layout, link_name

__all__ = ["SCHEMA_VERSION", "GroupInfo", "Hosts", "Layout", "RunDir", "RunFileError", "Table", "atomic_write",
           "link_name", "read_launches"]

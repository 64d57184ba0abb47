"""A two-node Ray cluster on this machine, every node on 127.0.0.1, for tests (ray.cluster_utils).

Run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment, which makes Ray take the loopback
address as this machine's address (otherwise it replaces 127.0.0.1 with the machine's routable IP
when it advertises or dials a node). Prints `address <host:port>` once both nodes are alive, then
reads commands from stdin: `kill-worker-node` ends the second node's raylet (a node that dies),
`stop` (or end of input) shuts the cluster down.
"""
import sys

from ray.cluster_utils import Cluster

NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 100 * 1024 * 1024}

cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
worker = cluster.add_node(**NODE)
cluster.wait_for_nodes()
print("address", cluster.address, flush=True)
for line in sys.stdin:
    if line.strip() == "kill-worker-node":
        cluster.remove_node(worker, allow_graceful=False)
        print("killed", flush=True)
    elif line.strip() == "stop":
        break
cluster.shutdown()

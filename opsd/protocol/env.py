"""The environment variables that carry opsd's settings across a process boundary: from a backend (``opsd run``'s
local nodes, a Kubernetes pod template) to the ranks' hooks and the node agent.

| variable | set by | read by | what |
|---|---|---|---|
| ``OPSD_RUN`` | the backend | the ranks' ``Monitor`` | the run the ranks belong to |
| ``OPSD_NODE`` | the backend | (the ranks' logs) | the node the ranks run on |
| ``OPSD_LAUNCH`` | the backend | the ranks' ``Monitor`` | the launch of the run the ranks belong to (a count) |
| ``OPSD_AGENT_SOCKET`` | the backend | the ranks, ``opsd agent`` | the node agent's datagram socket |
| ``OPSD_AGENT_HOST`` | the pod template | the ranks | without a socket: the node agent's address (``status.hostIP``) |
| ``OPSD_AGENT_DATAGRAM_PORT`` | the pod template | the ranks | its UDP port for the step reports (default 9465) |
| ``OPSD_AGENT_HTTP_PORT`` | the pod template | the ranks | its HTTP port for the policy and the dumps (default 9464) |
| ``OPSD_RANK_KEY`` | the pod template (a Secret) | the ranks | their run's key for the agent's network endpoints |
| ``OPSD_POLICY_FILE`` | the backend | the ranks, ``opsd agent`` | where the agent writes the controller's policy |
| ``OPSD_FLIGHT_DIR`` | the backend | the ranks, ``opsd agent`` | where ranks write Flight Recorder dumps |
| ``OPSD_CONTROLLER_TOKEN`` | the backend | ``opsd agent`` | the bearer token of its heartbeats |

And the operator's side (the CLI, and the controller's settings, docs/configuration.md): ``OPSD_URL``,
``OPSD_TOKEN``, ``OPSD_STATE_DIR``, ``OPSD_STATE_URL``, ``OPSD_CONFIG`` (the client's config file) and
``OPSD_GRAFANA_TOKEN``.

A fault-tolerant job's replica groups get theirs from ``opsd.protocol.ft`` (``TORCHFT_LIGHTHOUSE``,
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``OPSD_FT_MIN_REPLICAS``, ``OPSD_FT_HEAL_FROM_PEER`` and torchft's
timeouts).

``OPSD_LAUNCH`` is the local backend's generation; on Kubernetes, the JobSet's restart attempt (the pod's label
``jobset.sigs.k8s.io/restart-attempt``, through the downward API), or for a fault-tolerant run's replica group its
child Job's restart count (the label ``jobset.sigs.k8s.io/job-restart-attempt``).
"""

from __future__ import annotations

RUN_ENV = "OPSD_RUN"
NODE_ENV = "OPSD_NODE"
LAUNCH_ENV = "OPSD_LAUNCH"
AGENT_SOCKET_ENV = "OPSD_AGENT_SOCKET"
AGENT_HOST_ENV = "OPSD_AGENT_HOST"
AGENT_DATAGRAM_PORT_ENV = "OPSD_AGENT_DATAGRAM_PORT"
AGENT_HTTP_PORT_ENV = "OPSD_AGENT_HTTP_PORT"
RANK_KEY_ENV = "OPSD_RANK_KEY"
POLICY_FILE_ENV = "OPSD_POLICY_FILE"
FLIGHT_DIR_ENV = "OPSD_FLIGHT_DIR"
CONTROLLER_TOKEN_ENV = "OPSD_CONTROLLER_TOKEN"
URL_ENV = "OPSD_URL"
TOKEN_ENV = "OPSD_TOKEN"
STATE_DIR_ENV = "OPSD_STATE_DIR"
STATE_URL_ENV = "OPSD_STATE_URL"
CLIENT_CONFIG_ENV = "OPSD_CONFIG"
GRAFANA_TOKEN_ENV = "OPSD_GRAFANA_TOKEN"

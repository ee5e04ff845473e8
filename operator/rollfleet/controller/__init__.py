"""The operator: kopf handlers that turn RolloutFleets into engine pods and a gateway.

`desired`, `plan` and `status` are pure decisions; `reconciler` runs one loop per fleet
and does the I/O (through `rollfleet.kube` and `rollfleet.engine_client`); `handlers`
registers it with kopf as a daemon fed by two indexes; `daemons` says how a failed daemon
retries; `main` is `rollfleet operator`. RolloutRequests live in `requests`.
"""

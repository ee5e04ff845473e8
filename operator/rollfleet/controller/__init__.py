"""The operator: kopf handlers that turn RolloutFleets into engine pods and a gateway.

`desired`, `plan` and `status` are pure decisions; `reconciler` runs one loop per fleet
and does the I/O (through `rollfleet.kube` and `rollfleet.engine_client`); `handlers`
registers it with kopf (watch events and two indexes); `tasks` runs one task per object,
for fleets and requests alike; `main` is `rollfleet operator`. RolloutRequests live in `requests`.
"""

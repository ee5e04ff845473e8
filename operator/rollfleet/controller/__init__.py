"""The operator: kopf handlers that turn RolloutFleets into engine pods and a gateway.

`desired`, `plan` and `status` are pure decisions; `kube` and `engines` are the I/O;
`reconciler` runs one loop per fleet; `handlers` registers with kopf; `main` is
`rollfleet operator`. RolloutRequests live in `requests`.
"""

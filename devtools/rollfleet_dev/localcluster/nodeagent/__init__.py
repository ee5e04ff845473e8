"""The node agent: registers fake GPU/CPU nodes and runs the pods bound to them as local processes.

Started by `rollfleet cluster up` (`python -m rollfleet_dev.localcluster.nodeagent`). It talks
only to the kube-apiserver (aiohttp, JSON dicts) and to the processes it starts.
Module map: `config` (pools file), `kubeapi` (API client and watches), `nodes`
(registration, leases, heartbeats), `pods` (pod lifecycle), `processes` + `launcher`
(container processes in private mount namespaces), `volumes`, `env`, `downward`,
`probes`, `status` (pure pod status), `ipam`, `serviceproxy`, `logs`, `control`
(node stop/start), `cli` (`rollfleet cluster logs|node`), `agent` (wiring).
"""

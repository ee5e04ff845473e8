"""RolloutRequest controller: runs batches of rollouts through a fleet's gateway.

`plan` and `status` are pure; `results` is the durable results store (ConfigMaps);
`runner` runs one request; `handlers` registers the kopf daemon (importing it is
what the operator's entry module does to serve RolloutRequests).
"""

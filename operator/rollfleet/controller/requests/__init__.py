"""RolloutRequest controller: runs batches of rollouts through a fleet's gateway.

`plan` and `status` are pure; `results` is the durable results store (ConfigMaps);
`runner` runs one request; `handlers` registers it with kopf, as a task per request
(importing it is what the operator's entry module does to serve RolloutRequests).
"""

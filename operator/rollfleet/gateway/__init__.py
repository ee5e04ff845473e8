"""The per-fleet data plane: routes rollout requests to engines, aborts them by id, fails over.

Modules: `routing` (pure choice of engine), `registry` (engines from a pod watch or a
static list), `inflight` (which id runs where), `dialects` (request/stream shapes and
failover continuation), `proxy` (forwarding), `abort` (`POST /v1/abort`), `app` (HTTP
surface), `server` (the `rollfleet gateway` command). See docs/gateway.md.
"""

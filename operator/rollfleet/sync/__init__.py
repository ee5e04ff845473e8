"""The weight sync sidecar: moves a trainer's new weights into every engine of a fleet.

Runs as a container in the trainer pod (``rollfleet sync``). Layout:

- ``protocol``: the push record kept in the ConfigMap ``<fleet>-weights`` and every decision of the
  protocol (commit or roll back, recovery after a restart, engine phases, staleness).
  Pure.
- ``fleetversion``: ``fleet_weight_version``, the pure function the operator calls to
  derive the fleet's version and each engine's routability from the record.
- ``store``: where the record lives (the ConfigMap, or a file in static mode), written
  with compare-and-swap.
- ``engines``: the HTTP calls to engines and their discovery (pods or a static list).
- ``orchestrator``: runs a push, recovers after a restart, catches late engines up.
- ``server``: the localhost API for the trainer and the CLI entry point.

The trainer's side lives in the client distribution: the API's routes and bodies in
``rollfleet_client.sync_protocol``, and ``rollfleet_client.sync.SyncClient``.
"""

"""Rollfleet's development tooling: the local cluster and the demo. Not part of the product.

The operator image ships `rollfleet` only; this package (the `rollfleet-dev` distribution,
installed by `make env`) adds the `rollfleet cluster ...` and `rollfleet demo` commands
through the `rollfleet.commands` entry points (see `rollfleet_dev.cli`). No product module
imports it.
"""

"""Fleets' admin tokens derive from the operator's key and the fleet's identity, nothing else."""

from __future__ import annotations

import base64

from rollfleet.contract import OPERATOR_KEY_DATA, OPERATOR_KEY_SECRET
from rollfleet.controller.tokens import KEY_BYTES, fleet_token, key_secret

KEY = bytes(range(KEY_BYTES))


def test_a_fleet_gets_the_same_token_after_a_restart_and_no_other_fleet_gets_it() -> None:
    token = fleet_token(KEY, "team", "tiny", "uid-1")
    assert token == fleet_token(KEY, "team", "tiny", "uid-1")
    others = {
        fleet_token(KEY, "team", "tiny", "uid-2"),  # deleted and made again: a new token
        fleet_token(KEY, "team", "tinier", "uid-1"),
        fleet_token(KEY, "other", "tiny", "uid-1"),
        fleet_token(bytes(KEY_BYTES), "team", "tiny", "uid-1"),  # another operator key
    }
    assert token not in others and len(others) == 4
    # 256 bits, fit for a header and a file: URL-safe base64 without padding.
    assert len(token) == 43 and base64.urlsafe_b64decode(token + "=") and "=" not in token


def test_the_key_secret_holds_the_key_under_its_contract_name() -> None:
    secret = key_secret("ops", KEY)
    assert secret["metadata"] == {"name": OPERATOR_KEY_SECRET, "namespace": "ops"}
    assert base64.b64decode(secret["data"][OPERATOR_KEY_DATA]) == KEY

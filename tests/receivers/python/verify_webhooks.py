#!/usr/bin/env python3
"""Verifies requests the relay sent with the Standard Webhooks reference library
(`standardwebhooks` from PyPI), as a partner's receiver would. The reference library checks
`v1,` (HMAC) signatures only; a `whpk_` key checks `v1a,` (ed25519) signatures the way the
specification writes it, with `cryptography`'s ed25519 and the reference library's 5-minute
timestamp tolerance.

stdin: JSON {"requests": [{"headers": {...}, "body": "..."}], "accept": [secret, ...],
"reject": [secret, ...]}. For each request: every secret of "accept" verifies it; every secret
of "reject" does not; with the body changed, or the timestamp ten minutes old, no secret does.
Prints the counts as JSON.
"""

import base64
import json
import sys
import time

from standardwebhooks import Webhook


TOLERANCE_S = 5 * 60


def verifies_v1a(public_key, body, headers):
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key[len("whpk_"):]))
    msg_id, ts = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(ts)) > TOLERANCE_S:
        return False
    content = f"{msg_id}.{ts}.{body}".encode()
    for sig in headers["webhook-signature"].split(" "):
        version, _, b64 = sig.partition(",")
        if version != "v1a":
            continue
        try:
            key.verify(base64.b64decode(b64), content)
            return True
        except InvalidSignature:
            pass
    return False


def verifies(secret, body, headers):
    if secret.startswith("whpk_"):
        return verifies_v1a(secret, body, headers)
    try:
        Webhook(secret).verify(body, headers)
        return True
    except Exception:  # the library raises WebhookVerificationError (or a subclass)
        return False


def main():
    job = json.load(sys.stdin)
    out = {"requests": 0, "accepted": 0, "wrong_secret_rejected": 0,
           "tampered_rejected": 0, "stale_rejected": 0}
    for r in job["requests"]:
        out["requests"] += 1
        headers, body = r["headers"], r["body"]
        if all(verifies(s, body, headers) for s in job["accept"]):
            out["accepted"] += 1
        if not any(verifies(s, body, headers) for s in job["reject"]):
            out["wrong_secret_rejected"] += 1
        tampered = body + " "
        if not any(verifies(s, tampered, headers) for s in job["accept"]):
            out["tampered_rejected"] += 1
        stale = dict(headers)
        stale["webhook-timestamp"] = str(int(time.time()) - 600)
        if not any(verifies(s, body, stale) for s in job["accept"]):
            out["stale_rejected"] += 1
    print(json.dumps(out))


if __name__ == "__main__":
    main()

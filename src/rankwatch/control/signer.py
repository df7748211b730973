"""The webhook signing secret and the Standard Webhooks v1 signer both sides use.

A secret file holds one line "whsec_<base64>" of at least 24 bytes; the monitor signs with it (`Signer`), the
manager service verifies with the same parser (`load_secret`), so both read the file alike.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from standardwebhooks.webhooks import Webhook

from rankwatch.control.wire import AlertConfigError

if TYPE_CHECKING:
    pass

log = logging.getLogger("rankwatch.alerts")


SECRET_PREFIX = "whsec_"


SECRET_MIN_BYTES = 24


def new_secret() -> str:
    """A fresh secret: 'whsec_' + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()


def _parse_secret(text: str, where: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise AlertConfigError(f"{where}: empty secret file (expected one line 'whsec_<base64>')")
    if len(lines) > 1:
        raise AlertConfigError(f"{where}: {len(lines)} lines; a secret file holds one line 'whsec_<base64>'")
    line = lines[0]
    if not line.startswith(SECRET_PREFIX):
        raise AlertConfigError(f"{where}: the secret does not start with '{SECRET_PREFIX}'")
    raw = line[len(SECRET_PREFIX):]
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise AlertConfigError(f"{where}: the secret after '{SECRET_PREFIX}' is not base64") from None
    if len(key) < SECRET_MIN_BYTES:
        raise AlertConfigError(f"{where}: the secret holds {len(key)} bytes; at least {SECRET_MIN_BYTES} are needed")
    return line


def load_secret(path: Path | str) -> str:
    """The secret in `path` ('whsec_<base64 of >= 24 bytes>', one line); `AlertConfigError` naming the file when it
    is missing, unreadable, empty or malformed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AlertConfigError(f"{p}: secret file not found (write one with a fresh 'whsec_<base64>' line)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AlertConfigError(f"{p}: secret file unreadable ({type(exc).__name__}: {exc})") from None
    return _parse_secret(text, str(p))


def write_secret(path: Path | str) -> str:
    """Write a new secret to `path` (created, mode 0600; an existing file is an error, never overwritten)."""
    p = Path(path)
    secret = new_secret()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AlertConfigError(f"{p}: exists already; not overwriting a secret") from None
    except OSError as exc:
        raise AlertConfigError(f"{p}: cannot create the secret file ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret


class Signer:
    """Standard Webhooks v1 headers for one attempt (the `standardwebhooks` package signs)."""

    def __init__(self, secret: str) -> None:
        self._webhook = Webhook(_parse_secret(secret, "webhook secret"))

    def headers(self, msg_id: str, body: bytes, *, timestamp: int) -> dict[str, str]:
        sig = self._webhook.sign(msg_id, datetime.fromtimestamp(timestamp, tz=timezone.utc), body.decode("utf-8"))
        return {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(timestamp),
                "webhook-signature": sig}


_SIGNATURE_RE = re.compile(r"v[0-9]+[a-z]?,([A-Za-z0-9+/]+={0,2})")
"""One entry of a `webhook-signature` header: a version identifier, a comma, the signature in base64 (the Standard
Webhooks specification, "Signature scheme": a space-delimited list of `v1,<base64>` entries)."""


def signature_problem(header: str) -> str | None:
    """Why a `webhook-signature` header is not a list of signatures at all (one line), or None when every entry
    has the specification's shape; whether one of them matches is the verifier's question. standardwebhooks 1.3
    compares the header's entries as strings and never says that one is malformed, so the service asks here."""
    entries = header.split(" ")
    for n, entry in enumerate(entries):
        m = _SIGNATURE_RE.fullmatch(entry)
        if m is None:
            return f"entry {n + 1} of {len(entries)} is not '<version>,<base64>'"
        try:
            base64.b64decode(m.group(1), validate=True)
        except binascii.Error:
            return f"entry {n + 1} of {len(entries)} is not valid base64"
    return None

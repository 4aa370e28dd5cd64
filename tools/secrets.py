"""Secrets: which environment values are secret, and scrubbing them out of any text.

One place for it: the runner's child environment (tools/sandbox.py `minimal_env` keeps only an
allow-list, so no secret reaches a child at all), tool results before they reach the model
(tools/base.py), build logs and error texts before they are written (tools/build.py), and run
records (agent/records.py).

`scrub` replaces a secret's literal value and the simple encodings a kernel or a tool could turn it
into on the way out (base64 of several alignments, hex in both cases, URL-encoding, JSON escaping,
reversed) with `[redacted]`. It is a last line of defence: the sandbox keeps the secrets from being
read in the first place.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
import urllib.parse
from typing import Any, Iterable, Mapping

REDACTED = "[redacted]"
# a name that holds a secret: *_KEY, *_TOKEN, *SECRET*, *PASSWORD*, credentials, cookies, auth
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION)", re.I)
ALWAYS_SECRET = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
MIN_SECRET_LEN = 8  # shorter values ("1", "true") are settings, not secrets: redacting them would wreck texts


def is_secret_name(name: str) -> bool:
    return name.upper() in ALWAYS_SECRET or bool(SECRET_NAME.search(name))


def secrets_by_name(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret-looking variables of `environ` (default: this process's) long enough to matter."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if is_secret_name(k) and v and len(v) >= MIN_SECRET_LEN}


def secret_values(environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    values = set(secrets_by_name(environ).values()) | {s for s in extra if s and len(s) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


@functools.lru_cache(maxsize=64)
def encodings(secret: str) -> tuple[str, ...]:
    """The forms of `secret` that `scrub` replaces, longest first."""
    raw = secret.encode()
    forms = {secret, secret[::-1], urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret),
             json.dumps(secret)[1:-1], binascii.hexlify(raw).decode(), binascii.hexlify(raw).decode().upper(),
             "".join(f"%{b:02X}" for b in raw), "".join(f"%{b:02x}" for b in raw)}  # every byte %-encoded
    # base64 of the secret at each of the 3 alignments it can take inside a longer encoded text:
    # the characters that depend on the secret's bytes only (the edges are mixed with neighbours)
    for pad in range(3):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            text = enc(b"\0" * pad + raw).decode().rstrip("=")
            start = (pad * 4 + 2) // 3 + (1 if pad else 0)
            end = len(text) - 2
            if end - start >= MIN_SECRET_LEN:
                forms.add(text[start:end])
    return tuple(sorted((f for f in forms if len(f) >= MIN_SECRET_LEN), key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every secret (default: those of this process's environment) and its simple
    encodings replaced by [redacted]."""
    values = secret_values() if secrets is None else [s for s in secrets if s and len(s) >= MIN_SECRET_LEN]
    if not values or not isinstance(text, str):
        return text
    for secret in sorted(values, key=len, reverse=True):
        for form in encodings(secret):
            if form in text:
                text = text.replace(form, REDACTED)
    return text


def scrub_data(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """`scrub` applied to every string of JSON-like data (dict keys included)."""
    values = secret_values() if secrets is None else list(secrets)
    if not values:
        return value
    if isinstance(value, str):
        return scrub(value, values)
    if isinstance(value, dict):
        return {scrub_data(k, values): scrub_data(v, values) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_data(v, values) for v in value]
    return value

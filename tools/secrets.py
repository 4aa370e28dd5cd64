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


class SecretScrubber:
    """THE scrubber: replaces each secret's value (and its encodings, `encodings`) with a mark:
    `[REDACTED:<NAME>]` where the name helps a reader (run records), else `[redacted]`; says which
    secrets it found. Longest first, so a secret that contains another is replaced whole."""

    def __init__(self, secrets_by_name: Mapping[str, str], named: bool = True):
        self.secrets = sorted(((n, v) for n, v in secrets_by_name.items() if v and len(v) >= MIN_SECRET_LEN),
                              key=lambda nv: -len(nv[1]))
        self.named = named

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, named: bool = True) -> "SecretScrubber":
        """The secrets of `environ` (default: this process's, read now: a key set later is caught too)."""
        return cls(secrets_by_name(environ), named)

    def find(self, text: str) -> list[str]:
        """Names of the secrets whose value occurs in `text` (raw, JSON-escaped, or encoded)."""
        return [name for name, value in self.secrets if any(f in text for f in encodings(value))]

    def scrub_text(self, text: str) -> tuple[str, list[str]]:
        hits: list[str] = []
        for name, value in self.secrets:
            for form in encodings(value):
                if form in text:
                    text = text.replace(form, f"[REDACTED:{name}]" if self.named else REDACTED)
                    if name not in hits:
                        hits.append(name)
        return text, hits

    def scrub(self, obj: Any) -> tuple[Any, list[str]]:
        """`obj` (JSON-like: dicts with their keys, lists, strings, numbers) with every secret replaced."""
        hits: list[str] = []

        def walk(o: Any) -> Any:
            if isinstance(o, str):
                s, h = self.scrub_text(o)
                hits.extend(h)
                return s
            if isinstance(o, dict):
                return {walk(k): walk(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [walk(v) for v in o]
            return o

        return walk(obj), sorted(set(hits))


def _unnamed(secrets: Iterable[str] | None) -> SecretScrubber:
    values = secret_values() if secrets is None else list(secrets)
    return SecretScrubber({f"secret {i}": v for i, v in enumerate(values)}, named=False)


def scrub(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every secret (default: those of this process's environment) and its simple
    encodings replaced by [redacted]."""
    if not isinstance(text, str):
        return text
    return _unnamed(secrets).scrub_text(text)[0]


def scrub_data(value: Any, secrets: Iterable[str] | None = None) -> Any:
    """`scrub` applied to every string of JSON-like data (dict keys included)."""
    return _unnamed(secrets).scrub(value)[0]

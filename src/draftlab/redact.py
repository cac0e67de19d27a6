"""Secrets in URLs never leave the user's shell.

A sweep's `--storage postgresql://user:PASSWORD@host/db` and an `MLFLOW_TRACKING_URI` of
`https://user:PASSWORD@mlflow.example/` carry a password. Every place draftlab writes or prints
such a URL (MLflow params and tags, Optuna study attributes, the console, error text, files in a
run folder) passes it through `url()`; free text that may quote one (a driver's error message)
goes through `text()`. SQLAlchemy's own rendering (`URL.render_as_string(hide_password=True)`)
hides a database URL's password, the same `***` it prints in its own logs.

    redact.url("postgresql://u:s3cret@db/optuna")   # 'postgresql://u:***@db/optuna'
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

HIDDEN = "***"
URL_WITH_SECRET = re.compile(r"[A-Za-z][\w+.-]*://[^\s'\"<>]*(?:@|password=|token=)[^\s'\"<>]*")
# libpq and most drivers also take a password as a query parameter (`?password=…`)
SECRET_KEYS = {"password", "passwd", "pwd", "sslpassword", "token", "access_token", "secret"}
DB_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb", "sqlite", "mssql", "oracle", "cockroachdb")


def _hide_query(query: str) -> str:
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(k.lower() in SECRET_KEYS for k, _ in pairs):
        return query
    return urlencode([(k, HIDDEN if k.lower() in SECRET_KEYS else v) for k, v in pairs], safe="*")


def url(value: str, *, link: bool = False) -> str:
    """`value` with any password (in `user:…@` or a `password=` query parameter) shown as ***;
    anything that is not a URL (a journal file's path) is returned as it is. `link=True`: a
    link for a browser, with no user information at all (the browser asks for its own login)."""
    if not isinstance(value, str) or "://" not in value:
        return value
    scheme = value.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in DB_SCHEMES:
        try:
            from sqlalchemy.engine import make_url

            parsed = make_url(value)
            shown = parsed.render_as_string(hide_password=True)
            if any(k.lower() in SECRET_KEYS for k in parsed.query):
                shown = make_url(shown).update_query_dict(
                    {k: HIDDEN for k in parsed.query if k.lower() in SECRET_KEYS}).render_as_string(hide_password=True)
            return shown
        except Exception:  # noqa: BLE001 — not parseable by SQLAlchemy: the generic rules below
            pass
    try:
        parts = urlsplit(value)
    except ValueError:
        return value.split("://", 1)[0] + "://" + HIDDEN
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if link:
            netloc = host
        elif ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:{HIDDEN}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, _hide_query(parts.query), parts.fragment))


def passwords(value: str) -> list[str]:
    """The secrets a URL carries, as written and decoded (for scrubbing free text)."""
    if not isinstance(value, str) or "://" not in value:
        return []
    try:
        parts = urlsplit(value)
    except ValueError:
        return []
    found = []
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    if ":" in userinfo:
        found.append(userinfo.split(":", 1)[1])
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in SECRET_KEYS]
    found += [unquote(s) for s in found]
    return sorted({s for s in found if s and s != HIDDEN}, key=len, reverse=True)


def text(message: str, *urls: str) -> str:
    """`message` with each of `urls` shown redacted and their passwords, wherever else they
    appear (a driver quoting its connection string), replaced by ***; any other URL in it that
    carries a password, and the tracking URI's password, too (the CLI's error line uses this)."""
    message = URL_WITH_SECRET.sub(lambda m: url(m.group(0)), message)
    for u in (*urls, os.environ.get("MLFLOW_TRACKING_URI", "")):
        if not isinstance(u, str):
            continue
        message = message.replace(u, url(u))
        for secret in passwords(u):
            message = message.replace(secret, HIDDEN)
    return message

"""The Redis client of the cluster state (cluster/redis_state.py): credentials and TLS from the
environment, so a password never sits in a ConfigMap or on a command line, or from the URL itself:

    PDSERVE_REDIS_URL              the URL itself, when `--redis-url` is not given (a password in
                                   a command line is refused: the process list shows it)
    PDSERVE_REDIS_USERNAME         ACL user (AUTH user password); unset = Redis' `default` user
    PDSERVE_REDIS_PASSWORD         its password, or
    PDSERVE_REDIS_PASSWORD_FILE    a file holding it (a mounted Secret key)
    PDSERVE_REDIS_CA_FILE          CA bundle that verifies the server of a rediss:// URL (TLS,
                                   which redis-py does itself)

A refused password or an unreachable server is one line at start-up (`connect`), and whatever
shows the URL shows it through `mask_url`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

URL_ENV = "PDSERVE_REDIS_URL"  # the URL, where --redis-url is not given (cluster/cli/cli.py)
USERNAME_ENV = "PDSERVE_REDIS_USERNAME"
PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "PDSERVE_REDIS_PASSWORD_FILE"
CA_FILE_ENV = "PDSERVE_REDIS_CA_FILE"


class RedisAuthError(ValueError):
    """Redis refused this client's credentials (a ValueError: the CLI prints it as one line)."""


def mask_url(url: str) -> str:
    """`url` with the password it may carry (redis://user:PASSWORD@host, or ?password=) replaced
    by ***: what logs and error messages show."""
    parts, masked = urlsplit(url), url
    if parts.password is not None:
        userinfo = parts.netloc.rpartition("@")[0]
        masked = masked.replace(f"{userinfo}@", f"{parts.username or ''}:***@", 1)
    if "password=" in parts.query:
        query = "&".join("password=***" if q.startswith("password=") else q for q in parts.query.split("&"))
        masked = masked.replace(f"?{parts.query}", f"?{query}", 1)
    return masked


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value == "":
        raise ValueError(f"{name} is set but empty")
    return value


def _password(environ: Mapping[str, str]) -> str | None:
    """PDSERVE_REDIS_PASSWORD, or the contents of PDSERVE_REDIS_PASSWORD_FILE (one trailing newline dropped)."""
    password, path = _env(environ, PASSWORD_ENV), _env(environ, PASSWORD_FILE_ENV)
    if path is None:
        return password
    if password is not None:
        raise ValueError(f"set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, not both")
    try:
        with open(path) as f:
            password = f.read().removesuffix("\n").removesuffix("\r")
    except OSError as exc:
        raise ValueError(f"{PASSWORD_FILE_ENV}={path}: {exc.strerror}") from None
    if not password:
        raise ValueError(f"{PASSWORD_FILE_ENV}={path} is empty")
    return password


def connection_options(url: str, environ: Mapping[str, str]) -> dict:
    """redis-py keyword arguments for `url` from the PDSERVE_REDIS_* variables of `environ`
    (module docstring). Raises ValueError naming the variable for a value that cannot work: an
    empty one, a password or user given twice (also in the URL), a user without a password, an
    unreadable or empty password file, a CA file that is not a file or comes without rediss://."""
    parts, options = urlsplit(url), {}
    password, username, ca_file = _password(environ), _env(environ, USERNAME_ENV), _env(environ, CA_FILE_ENV)
    if password is not None:
        if parts.password is not None:
            raise ValueError(f"the Redis URL {mask_url(url)} carries a password and {PASSWORD_ENV}(_FILE) "
                             "is set too: give it once")
        options["password"] = password
    if username is not None:
        if parts.username:
            raise ValueError(f"the Redis URL {mask_url(url)} names a user and {USERNAME_ENV} is set too: give it once")
        if password is None and parts.password is None:
            raise ValueError(f"{USERNAME_ENV}={username} needs {PASSWORD_ENV} or {PASSWORD_FILE_ENV}")
        options["username"] = username
    if ca_file is not None:
        if parts.scheme != "rediss":
            raise ValueError(f"{CA_FILE_ENV} verifies a TLS server: the Redis URL must be rediss://, "
                             f"got {mask_url(url)}")
        if not os.path.isfile(ca_file):
            raise ValueError(f"{CA_FILE_ENV}={ca_file} is not a file")
        options["ssl_ca_certs"] = ca_file
    return options


def connect(url: str, environ: Mapping[str, str] | None = None, **kwargs):
    """A `redis.Redis` for `url` with the credentials and TLS options of `environ` (default
    os.environ), checked with one PING: a refused or missing password raises RedisAuthError, an
    unreachable server (or a failed TLS handshake) ValueError, each one line naming Redis and
    the masked URL. `kwargs` go to `redis.Redis.from_url`."""
    import redis  # only the Redis backend needs the client

    options = connection_options(url, os.environ if environ is None else environ)
    client = redis.Redis.from_url(url, **options, **kwargs)
    where = mask_url(url)
    user = options.get("username") or urlsplit(url).username or "default"
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        client.close()
        if client.get_connection_kwargs().get("password") is None:  # the server's words are about HELLO here
            raise RedisAuthError(f"Redis at {where} requires a password: set {USERNAME_ENV} and {PASSWORD_ENV} "
                                 f"(or {PASSWORD_FILE_ENV})") from None
        raise RedisAuthError(f"Redis at {where} refused the password of user {user!r} ({exc})") from None
    except redis.ConnectionError as exc:
        client.close()
        raise ValueError(f"cannot reach Redis at {where}: {exc}") from None
    logger.info("cluster state: Redis at %s, user %s, %s", where, user,
                "TLS" if urlsplit(url).scheme == "rediss" else "no TLS")
    return client

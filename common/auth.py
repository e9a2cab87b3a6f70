"""Who is calling: bearer tokens mapped to tenants, and what a tenant may see (torch-free, grpc-free).

A token file (JSON, e.g. a Kubernetes secret mounted into the pod) lists the accepted tokens::

    {"tokens": [
        {"tenant": "team-a", "token": "…"},                       # a tenant's token
        {"tenant": "team-b", "token_sha256": "<hex digest>"},    # or only its sha256
        {"tenant": "ops", "token": "…", "role": "admin"}          # admin: sees and touches every tenant's work
    ]}

Without a token file authentication is off: every caller is the one anonymous principal, with access to
everything (the local default, bound to 127.0.0.1). With one, every RPC but the health checks needs
``authorization: Bearer <token>``; a tenant sees only what it created, and another tenant's ids are NOT_FOUND,
so their existence is not revealed.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path

from strop.common.errors import InvalidArgument, NotFound, StropError


class Unauthenticated(StropError):
    """No token, or one the service does not know."""

    grpc_code = "UNAUTHENTICATED"


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False

    def can_see(self, tenant: str) -> bool:
        """Whether this caller may see an object created by ``tenant``."""
        return self.admin or tenant == self.tenant


ANONYMOUS = Principal(tenant="", admin=True)  # authentication off
_CURRENT: contextvars.ContextVar[Principal] = contextvars.ContextVar("strop_principal", default=ANONYMOUS)


def current() -> Principal:
    """The principal of the call being served (set by the servers' interceptor)."""
    return _CURRENT.get()


def set_current(principal: Principal) -> contextvars.Token:
    return _CURRENT.set(principal)


def reset_current(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_tenant_name(tenant: str) -> str:
    """A tenant name also names the tenant's directory in the artifact store: letters, digits, '.', '_', '-'."""
    if tenant and (not isinstance(tenant, str) or not _TENANT_RE.match(tenant) or ".." in tenant):
        raise InvalidArgument(
            f"tenant name {tenant!r} is not valid (letters, digits, '.', '_', '-'; at most 128)"
        )
    return tenant


def check_visible(tenant: str, what: str) -> None:
    """NOT_FOUND, exactly as for an id that does not exist, unless the caller may see ``tenant``'s object."""
    if not current().can_see(tenant):
        raise NotFound(f"{what} not found")


class TokenTable:
    """The accepted bearer tokens; lookups compare sha256 digests in constant time."""

    def __init__(self, entries: list[tuple[str, Principal]]) -> None:
        self._entries = entries  # (sha256 hex of the token, principal)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Read a token file (see the module docstring).

        Raises:
            InvalidArgument: the file is not such a JSON document.
        """
        try:
            doc = json.loads(Path(path).read_text())
            entries = []
            for e in doc["tokens"]:
                digest = e.get("token_sha256") or hashlib.sha256(e["token"].encode()).hexdigest()
                if e.get("role", "user") not in ("user", "admin") or not e["tenant"]:
                    raise ValueError(f"bad entry for tenant {e.get('tenant')!r}")
                check_tenant_name(str(e["tenant"]))
                entries.append((digest.lower(), Principal(str(e["tenant"]), admin=e.get("role") == "admin")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"token file {str(path)!r}: {exc}") from None
        if not entries:
            raise InvalidArgument(f"token file {str(path)!r} lists no tokens")
        return cls(entries)

    def principal(self, authorization: str | None) -> Principal:
        """The principal of an ``authorization`` metadata value (``Bearer <token>``).

        Raises:
            Unauthenticated: missing, malformed or unknown.
        """
        if not authorization:
            raise Unauthenticated(
                "this service needs a bearer token (metadata authorization: Bearer <token>)"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        found = None
        for (
            known,
            principal,
        ) in self._entries:  # every entry compared: the time says nothing about which matched
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found

"""Who a request comes from (`client_of`), and the session quotas that follow a client, not only a tenant.

A tenant is a `cache_salt`, which every client picks freely: a quota per tenant alone bounds nothing,
since a client that invents salts gets a fresh one with each. So the session folder also has quotas per
client (`max_sessions_per_client`, `max_session_gb_per_client`) and caps over the whole folder
(`max_sessions`, `max_session_gb`), checked together with the tenant's at every save (`SessionQuotas`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import secrets
from dataclasses import dataclass

from fastapi import Request

from kvbank.server.errors import APIError
from kvbank.server.limits import ServerLimits

#: keys the credential fingerprints: they tell keys apart within this process and say nothing of a key
_FINGERPRINT_KEY = secrets.token_bytes(32)
#: the prefix of an IPv6 address that one host (one customer of a provider) usually holds whole
_IPV6_HOST_PREFIX = 64


def client_of(request: Request) -> str:
    """The requester's identity, for quotas and limits per client.

    Its peer address (an IPv6 address by its /64, which one host usually holds whole, so that it cannot
    count as many clients; an IPv4-mapped one as IPv4), and, when the request carries a bearer credential
    (`Authorization: Bearer ...`), a short fingerprint of it, so that behind one address (a proxy, a NAT)
    different keys are different clients. The credential is never kept: its fingerprint is keyed with a
    secret of this process, so it cannot be matched against guessed keys, nor across restarts.
    Forwarded-for headers are not trusted: anyone may send one. E.g. "127.0.0.1" or "10.1.2.3 key 9f3a...".
    """
    address = _address(request.client.host if request.client is not None else "")
    scheme, _, credential = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return address
    digest = hashlib.blake2b(credential.strip().encode(), key=_FINGERPRINT_KEY, digest_size=8).hexdigest()
    return f"{address} key {digest}"


def _address(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"  # not an address (a unix socket's peer, a test transport's name)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/{_IPV6_HOST_PREFIX}", strict=False))
    return str(ip)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A save being written: counted against every quota until it is settled."""

    tenant: str
    name: str
    client: str
    size: int


class SessionQuotas:
    """The session quotas of one server: per tenant, per client, and over the whole folder.

    A save is checked against what the folder holds (scanned by the caller just before) with every
    other save still being written counted at its new size (`reserve` ... `settle`), so two saves cannot
    each fit and together exceed a quota; saving over a session of the same name counts it once. Which
    client saved a file is known for the saves of this server process: a file saved before it started
    counts toward its tenant and the folder, not toward a client.
    """

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._owners: dict[tuple[str, str], str] = {}
        self._writing: dict[int, Reservation] = {}
        self._ids = itertools.count()

    def reserve(self, held: dict[str, dict[str, int]], reservation: Reservation) -> int:
        """Check a save of `reservation.size` bytes against every quota, given the bytes of each session the
        folder holds by tenant and name (`held`), and count it until `settle`; returns its id. Raises
        APIError 429 (a count) or 507 (bytes) naming the limit and its flag."""
        others = {(tenant, name): size for tenant, files in held.items() for name, size in files.items()}
        others.update({(r.tenant, r.name): r.size for r in self._writing.values()})
        others.pop((reservation.tenant, reservation.name), None)  # the session it replaces
        owners = {**self._owners, **{(r.tenant, r.name): r.client for r in self._writing.values()}}
        limits = self.limits
        scopes = (
            (
                "this tenant (cache_salt)",
                "per-tenant",
                [size for (tenant, _), size in others.items() if tenant == reservation.tenant],
                limits.max_sessions_per_tenant,
                limits.session_bytes_per_tenant(),
            ),
            (
                "this client (its address and bearer key, whatever cache_salt it names)",
                "per-client",
                [size for key, size in others.items() if owners.get(key) == reservation.client],
                limits.max_sessions_per_client,
                limits.session_bytes_per_client(),
            ),
            (
                "the session folder (all tenants)",
                "",
                list(others.values()),
                limits.max_sessions,
                limits.session_bytes(),
            ),
        )
        for who, flag_suffix, sizes, count_limit, byte_limit in scopes:
            _check(who, flag_suffix, sizes, reservation.size, count_limit, byte_limit)
        rid = next(self._ids)
        self._writing[rid] = reservation
        return rid

    def settle(self, rid: int, saved: bool) -> None:
        """The save `rid` is written (`saved`: its client now owns the session) or given up."""
        reservation = self._writing.pop(rid)
        if saved:
            self._owners[(reservation.tenant, reservation.name)] = reservation.client

    def forget(self, tenant: str, name: str) -> None:
        """The tenant's session `name` was deleted: it counts toward its client no longer."""
        self._owners.pop((tenant, name), None)


def _check(
    who: str, flag_suffix: str, sizes: list[int], size: int, count_limit: int | None, byte_limit: int | None
) -> None:
    """Refuse a save of `size` bytes beside the other sessions (`sizes`) that one quota counts."""
    suffix = f"-{flag_suffix}" if flag_suffix else ""
    if count_limit is not None and len(sizes) >= count_limit:
        raise APIError(
            f"{who} keeps {len(sizes)} sessions, its limit (--max-sessions{suffix}); "
            "delete one (POST /v1/sessions/delete) or save over one of the same name",
            status=429,
            param="session",
            code="too_many_sessions",
        )
    used = sum(sizes)
    if byte_limit is not None and used + size > byte_limit:
        raise APIError(
            f"this session needs {size} bytes and {who} keeps {used} in other sessions, over its limit "
            f"of {byte_limit} (--max-session-gb{suffix} {byte_limit / 2**30:g}); delete a session first",
            status=507,
            param="session",
            code="session_quota_exceeded",
        )

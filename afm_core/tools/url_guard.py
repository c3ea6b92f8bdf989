"""Which addresses the crawl server may fetch: public ones, plus an allow-list (a guard against SSRF).

A model writes the URLs that ``<crawl_page>`` fetches. Without a guard it could make the crawl server call
our own services on 127.0.0.1 (the sandbox's ``POST /run``, the tool servers), the cluster's private network,
or a cloud metadata endpoint (169.254.169.254), and read the answers in its observation (OWASP, *Server Side
Request Forgery Prevention Cheat Sheet*). The guard refuses every address that is not globally routable
(:attr:`ipaddress.IPv4Address.is_global`: loopback, private, link-local, shared, reserved, ...) or is
multicast, IPv4-mapped IPv6 forms included, unless the allow-list names it. It checks

- the host of each URL when it is an IP literal (:meth:`UrlGuard.check_url`), for the first request and for
  every redirect (the crawl server follows redirects itself, one hop at a time);
- every address a host name resolves to (:class:`GuardedResolver`, the resolver of the fetching session), so
  what is checked is what is connected to (no second resolution an attacker's DNS could answer differently).

Allow-list entries: an address or network (``10.1.0.0/16``, ``127.0.0.1``) for every port, or one address
and port (``127.0.0.1:8080``, ``[::1]:8080``), e.g. the local pages server of the offline web tools.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class BlockedAddressError(OSError):
    """A URL's host is, or resolves to, an address the guard refuses."""


@dataclass(frozen=True)
class _Allowed:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


def parse_allow_entry(entry: str) -> _Allowed:
    """One allow-list entry: ``ADDRESS[/PREFIX]``, ``IPv4:PORT`` or ``[IPv6]:PORT``.

    Raises:
        ValueError: the entry is none of these (the message quotes it).
    """
    text = entry.strip()
    try:
        if text.startswith("["):
            host, _, port = text[1:].partition("]:")
            return _Allowed(ipaddress.ip_network(host), int(port))
        if text.count(":") == 1:
            host, port = text.split(":")
            return _Allowed(ipaddress.ip_network(host), int(port))
        return _Allowed(ipaddress.ip_network(text, strict=False), None)
    except ValueError as e:
        raise ValueError(
            f"crawl allow-list entry {entry!r}: expected ADDRESS[/PREFIX], IPv4:PORT or [IPv6]:PORT ({e})"
        ) from e


def refusal(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be fetched (None when it is a public address)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address (cloud metadata lives here)"
    if ip.is_private:
        return "a private address"
    if ip.is_multicast or not ip.is_global:
        return "not a public address"
    return None


class UrlGuard:
    """Decides whether an address (and port) may be fetched.

    Args:
        allow: allow-list entries (see :func:`parse_allow_entry`).

    Raises:
        ValueError: an allow-list entry cannot be read.
    """

    def __init__(self, allow: list[str] | tuple[str, ...] = ()) -> None:
        self.allow = [parse_allow_entry(e) for e in allow]

    def check_ip(self, ip: IPAddress, port: int) -> None:
        """Raises:
        BlockedAddressError: ``ip`` is not public and not allow-listed for ``port``.
        """
        why = refusal(ip)
        if why is None:
            return
        for entry in self.allow:
            if ip in entry.network and entry.port in (None, port):
                return
        raise BlockedAddressError(f"refused to fetch {ip} port {port}: {why} (not in the crawl server's allow-list)")

    def check_url(self, url: URL) -> None:
        """Check a URL before a request: an http(s) scheme, and its host when that is an IP literal.

        Raises:
            BlockedAddressError: a refused literal address, or a scheme other than http/https.
        """
        if url.scheme not in ("http", "https"):
            raise BlockedAddressError(f"refused to fetch {url}: only http and https URLs are crawled")
        try:
            ip = ipaddress.ip_address(url.raw_host or "")
        except ValueError:
            return  # a host name: GuardedResolver checks what it resolves to
        self.check_ip(ip, url.port or 0)


class GuardedResolver(AbstractResolver):
    """An aiohttp resolver that drops the addresses :class:`UrlGuard` refuses; none left: the request fails."""

    def __init__(self, guard: UrlGuard, resolver: AbstractResolver | None = None) -> None:
        self.guard = guard
        self._resolver = resolver or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._resolver.resolve(host, port, family)
        kept, refused = [], None
        for result in results:
            try:
                self.guard.check_ip(ipaddress.ip_address(result["host"]), port)
                kept.append(result)
            except BlockedAddressError as e:
                refused = e
        if not kept:
            raise BlockedAddressError(f"{host} resolves only to refused addresses: {refused}") from refused
        return kept

    async def close(self) -> None:
        await self._resolver.close()

"""The addresses a tenant's webhook may reach: public unicast ones only. `not_public` is the rule, written once.

An address is public when it lies in none of the blocks below, the standard library does not call it reserved (the
IETF's unassigned space), and it does call it global (`is_global`). The blocks are those the IANA special-purpose
address registries (IPv4 and IPv6) mark as not globally reachable, multicast, and the deprecated IPv6 ranges the
registries no longer list. They are written out because the standard library's tables lag the registries and differ
between releases (3.11.7 calls 2002::/16, 3fff::/20, fec0::/10 and 192.0.0.8 global; later releases refuse some of
these and let the anycasts inside 2001::/23 through): the rule must not change with the Python the gateway runs on.

Decided beyond the registries:
- An IPv6 form that carries an IPv4 address is judged by that address where something connects to it: IPv4-mapped
  (::ffff:0:0/96: the socket does) and NAT64's well-known prefix (64:ff9b::/96: a translator does; a DNS64 network
  hands it out for every IPv4-only host, so refusing it whole would refuse those webhooks).
- The other such forms are refused whatever they carry: IPv4-compatible (::/96) and IPv4-translated (SIIT,
  ::ffff:0:0:0/96), both obsolete; NAT64 local-use (64:ff9b:1::/48: where the IPv4 address sits is the operator's
  choice); 6to4 (2002::/16, deprecated) and Teredo (2001::/32: its client address is obfuscated).
- The IETF protocol-assignment blocks (192.0.0.0/24, 2001::/23) are refused whole, the anycasts the registries mark
  globally reachable inside them (PCP, TURN, AMT, AS112, ORCHIDv2, DRIP) included: none is a webhook's server. So is
  192.88.99.0/24, the deprecated 6to4 relay anycast (its 6a44 relay too).
- A zone id (fe80::1%eth0) names a link: an address that carries one is never public.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

# First match names the refusal, so a block comes before any block that holds it.
IPV4_BLOCKS = tuple(
    (IPv4Network(block), name)
    for block, name in (
        ("0.0.0.0/8", "'this network'"),
        ("10.0.0.0/8", "private-use"),
        ("100.64.0.0/10", "shared address space (carrier-grade NAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private-use"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation (TEST-NET-1)"),
        ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
        ("192.168.0.0/16", "private-use"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation (TEST-NET-2)"),
        ("203.0.113.0/24", "documentation (TEST-NET-3)"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "limited broadcast"),
        ("240.0.0.0/4", "reserved"),
    )
)
IPV6_BLOCKS = tuple(
    (IPv6Network(block), name)
    for block, name in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible (deprecated)"),
        ("::ffff:0:0:0/96", "IPv4-translated (SIIT)"),
        ("64:ff9b:1::/48", "NAT64 local-use"),
        ("100::/64", "discard-only"),
        ("100:0:0:1::/64", "dummy prefix"),
        ("2001::/32", "Teredo"),
        ("2001:2::/48", "benchmarking"),
        ("2001:10::/28", "ORCHID (deprecated)"),
        ("2001:db8::/32", "documentation"),
        ("2001::/23", "IETF protocol assignments"),
        ("2002::/16", "6to4 (deprecated)"),
        ("3ffe::/16", "6bone (returned)"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "SRv6 SIDs"),
        ("fc00::/7", "unique-local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    )
)
NAT64 = IPv6Network("64:ff9b::/96")


def not_public(ip: IPv4Address | IPv6Address) -> str | None:
    """Why a webhook may not reach `ip` ("loopback", "IPv4-mapped 10.0.0.1, which is private-use"), None if it may."""
    if isinstance(ip, IPv6Address):
        if ip.scope_id:
            return "scoped to a link (a zone id)"
        if ip.ipv4_mapped is not None:
            return _carrying("IPv4-mapped", ip.ipv4_mapped)
        if ip in NAT64:
            return _carrying("NAT64", IPv4Address(int(ip) & 0xFFFFFFFF))
    blocks: tuple[tuple[IPv4Network | IPv6Network, str], ...] = IPV4_BLOCKS if ip.version == 4 else IPV6_BLOCKS
    for block, name in blocks:
        if ip in block:
            return name
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "not global"
    return None


def _carrying(form: str, inner: IPv4Address) -> str | None:
    why = not_public(inner)
    return None if why is None else f"{form} {inner}, which is {why}"

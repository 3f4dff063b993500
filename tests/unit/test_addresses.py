"""The addresses a tenant's webhook may reach (gateway/tenancy/addresses.py): every block of the IANA special-purpose
registries (both families) at its first and last address, the IPv6 forms that carry an IPv4 address with private and
public ones inside, the deprecated and non-global IPv6 ranges, zone ids; and the public addresses that must stay
accepted, next to the blocks' edges. The URL forms getaddrinfo reads (decimal, octal, hex) are in
test_tenant_webhooks.py."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from gateway.tenancy.addresses import not_public

# The IANA IPv4 and IPv6 special-purpose address registries, every entry: (block, public). Public follows the
# registry's "Globally Reachable" except where a comment says why not.
IANA_IPV4 = [
    ("0.0.0.0/8", False),
    ("0.0.0.0/32", False),
    ("10.0.0.0/8", False),
    ("100.64.0.0/10", False),
    ("127.0.0.0/8", False),
    ("169.254.0.0/16", False),
    ("172.16.0.0/12", False),
    ("192.0.0.0/24", False),
    ("192.0.0.0/29", False),
    ("192.0.0.8/32", False),
    ("192.0.0.9/32", False),  # PCP anycast, globally reachable: refused with its protocol-assignment block
    ("192.0.0.10/32", False),  # TURN anycast: likewise
    ("192.0.0.170/32", False),
    ("192.0.0.171/32", False),
    ("192.0.2.0/24", False),
    ("192.31.196.0/24", True),
    ("192.52.193.0/24", True),
    ("192.88.99.0/24", False),
    ("192.88.99.2/32", False),  # 6a44 relay anycast: refused with the deprecated 6to4 relay block
    ("192.168.0.0/16", False),
    ("192.175.48.0/24", True),
    ("198.18.0.0/15", False),
    ("198.51.100.0/24", False),
    ("203.0.113.0/24", False),
    ("240.0.0.0/4", False),
    ("255.255.255.255/32", False),
]
IANA_IPV6 = [
    ("::1/128", False),
    ("::/128", False),
    ("::ffff:0:0/96", False),  # its edges carry 0.0.0.0 and 255.255.255.255; a public IPv4 inside is below
    ("64:ff9b::/96", False),  # likewise
    ("64:ff9b:1::/48", False),
    ("100::/64", False),
    ("100:0:0:1::/64", False),
    ("2001::/23", False),
    ("2001::/32", False),
    ("2001:1::1/128", False),  # PCP, TURN and DNS-SD anycasts, AMT, AS112, ORCHIDv2, DETs: globally reachable,
    ("2001:1::2/128", False),  # refused with 2001::/23, as Python 3.11 refuses them
    ("2001:1::3/128", False),
    ("2001:2::/48", False),
    ("2001:3::/32", False),
    ("2001:4:112::/48", False),
    ("2001:10::/28", False),
    ("2001:20::/28", False),
    ("2001:30::/28", False),
    ("2001:db8::/32", False),
    ("2002::/16", False),
    ("2620:4f:8000::/48", True),
    ("3fff::/20", False),
    ("5f00::/16", False),
    ("fc00::/7", False),
    ("fe80::/10", False),
]
# What the registries no longer list, or list elsewhere: deprecated, reserved, multicast.
OTHER_BLOCKS = [
    ("::/96", False),  # IPv4-compatible
    ("::ffff:0:0:0/96", False),  # IPv4-translated (SIIT)
    ("fec0::/10", False),  # site-local
    ("3ffe::/16", False),  # 6bone
    ("ff00::/8", False),
    ("224.0.0.0/4", False),
    ("233.252.0.0/24", False),  # MCAST-TEST-NET
    ("200::/7", False),  # the IETF's reserved space: once OSI NSAP-mapped
    ("4000::/3", False),
    ("e000::/4", False),
]


def edges(blocks: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    found = []
    for block, public in blocks:
        network = ip_network(block)
        found += [(str(network.network_address), public), (str(network.broadcast_address), public)]
    return found


EMBEDDED = [
    # IPv4-mapped: judged by the IPv4 address inside.
    ("::ffff:127.0.0.1", False),
    ("::ffff:7f00:1", False),
    ("::ffff:10.1.2.3", False),
    ("::ffff:169.254.169.254", False),
    ("::ffff:100.64.0.1", False),
    ("::ffff:192.0.0.9", False),
    ("::ffff:224.0.0.1", False),
    ("::ffff:93.184.216.34", True),
    # NAT64's well-known prefix: likewise.
    ("64:ff9b::127.0.0.1", False),
    ("64:ff9b::a9fe:a9fe", False),
    ("64:ff9b::10.0.0.1", False),
    ("64:ff9b::100.64.0.1", False),
    ("64:ff9b::192.168.1.1", False),
    ("64:ff9b::93.184.216.34", True),
    ("64:ff9b::8.8.8.8", True),
    # Refused whatever they carry.
    ("::ffff:0:7f00:1", False),  # SIIT of 127.0.0.1
    ("::ffff:0:127.0.0.1", False),
    ("::ffff:0:93.184.216.34", False),
    ("::7f00:1", False),  # IPv4-compatible
    ("::169.254.169.254", False),
    ("::93.184.216.34", False),
    ("64:ff9b:1::7f00:1", False),  # NAT64 local-use
    ("64:ff9b:1:5db8:d822::", False),
    ("2002:7f00:1::1", False),  # 6to4
    ("2002:a9fe:a9fe::1", False),
    ("2002:5db8:d822::1", False),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),  # Teredo (RFC 4380's example)
    ("2001:0:7f00:1::", False),
]
IPV6_RANGES = [
    ("fec0::1", False),  # site-local, deprecated
    ("feff:ffff::1", False),
    ("fd12:3456::1", False),
    ("fe80::1", False),
    ("fe80::1%eth0", False),  # zone ids
    ("fe80::1%25", False),
    ("2606:4700:4700::1111%eth0", False),
    ("ff02::1", False),
    ("ff0e::1", False),  # multicast of global scope
    ("100::1", False),
    ("1000::1", False),
    ("8000::1", False),
    ("2001:db8:85a3::8a2e:370:7334", False),
    ("3fff:fff::1", False),
    ("5f00:1::1", False),
]
PUBLIC = [
    ("1.1.1.1", True),
    ("8.8.8.8", True),
    ("93.184.216.34", True),
    ("9.255.255.255", True),
    ("11.0.0.0", True),
    ("100.63.255.255", True),
    ("100.128.0.0", True),
    ("126.255.255.255", True),
    ("128.0.0.0", True),
    ("169.253.255.255", True),
    ("169.255.0.0", True),
    ("172.15.255.255", True),
    ("172.32.0.0", True),
    ("191.255.255.255", True),
    ("192.0.1.0", True),
    ("192.0.3.0", True),
    ("192.88.98.255", True),
    ("192.88.100.0", True),
    ("192.167.255.255", True),
    ("192.169.0.0", True),
    ("198.17.255.255", True),
    ("198.20.0.0", True),
    ("198.51.99.255", True),
    ("198.51.101.0", True),
    ("203.0.112.255", True),
    ("203.0.114.0", True),
    ("223.255.255.255", True),
    ("2606:4700:4700::1111", True),
    ("2001:4860:4860::8888", True),
    ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("2001:200::1", True),  # the first /32 past 2001::/23
    ("2001:db9::1", True),
    ("2003::1", True),
    ("2a00:1450:4001::1", True),
    ("3fff:1000::1", True),  # past 3fff::/20
    ("2620:4f:7fff:ffff::1", True),
    ("2620:4f:8001::1", True),
]
TABLE = [*edges(IANA_IPV4), *edges(IANA_IPV6), *edges(OTHER_BLOCKS), *EMBEDDED, *IPV6_RANGES, *PUBLIC]


@pytest.mark.parametrize(("address", "public"), TABLE)
def test_an_address_is_public_only_when_global_and_in_no_special_block(address: str, public: bool) -> None:
    ip = ip_address(address)
    why = not_public(ip)
    assert (why is None) is public, why
    # Never looser than the standard library, whichever Python runs this.
    if not ip.is_global:
        assert why is not None


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("::ffff:0:7f00:1", "IPv4-translated (SIIT)"),
        ("fec0::1", "site-local (deprecated)"),
        ("::ffff:7f00:1", "IPv4-mapped 127.0.0.1, which is loopback"),
        ("64:ff9b::a9fe:a9fe", "NAT64 169.254.169.254, which is link-local"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
        ("2002:a9fe:a9fe::1", "6to4 (deprecated)"),
        ("2001:db8::1", "documentation"),
        ("255.255.255.255", "limited broadcast"),
        ("fe80::1%eth0", "scoped to a link (a zone id)"),
        ("4000::1", "reserved"),
    ],
)
def test_a_refusal_says_what_the_address_is(address: str, why: str) -> None:
    assert not_public(ip_address(address)) == why

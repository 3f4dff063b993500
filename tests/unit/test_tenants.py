"""API-key authentication: only the exact key authenticates, never one that is merely close to it, whether close in
its own characters or in its SHA-256 hash; a missing or malformed Authorization header is told apart."""

from __future__ import annotations

import hashlib
from itertools import count
from types import CodeType

import pytest

from gateway.errors import AuthenticationFailed
from gateway.settings import TenantSettings
from gateway.tenants import TenantDirectory, hash_key, new_api_key

# Fixed rather than new_api_key(), so the brute-force search below takes the same (short) time on every run.
KEY = "bk-7QhXoR2m1c0Jx9bTzL4pVw8sK3nD6yFgA5eU0iHtWqE"
OTHER_KEY = "bk-Zk2vN8rT4pQ1wX7yB3mC9dF6gH0jL5sA8eR2tU4iO"
HEX = "0123456789abcdef"


@pytest.fixture
def directory() -> TenantDirectory:
    return TenantDirectory(
        [
            TenantSettings(id="a", key_hashes=[hash_key(KEY), hash_key(OTHER_KEY)]),
            TenantSettings(id="b", key_hashes=[hash_key("bk-b-key")]),
        ]
    )


def refused(directory: TenantDirectory, authorization: str | None, message: str) -> None:
    with pytest.raises(AuthenticationFailed, match=message) as caught:
        directory.authenticate(authorization)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")


def other_char(char: str) -> str:
    return "A" if char != "A" else "B"


def test_each_key_authenticates_as_its_own_tenant(directory: TenantDirectory) -> None:
    assert directory.authenticate(f"Bearer {KEY}").id == "a"
    assert directory.authenticate(f"Bearer {OTHER_KEY}").id == "a"
    assert directory.authenticate("Bearer bk-b-key").id == "b"
    # The scheme is case-insensitive and the space around the key is not part of it.
    assert directory.authenticate(f"bearer   {KEY} ").id == "a"


def test_a_fresh_key_authenticates_through_its_hash() -> None:
    key = new_api_key()
    assert TenantDirectory([TenantSettings(id="t", key_hashes=[hash_key(key)])]).authenticate(f"Bearer {key}").id == "t"


def test_a_key_that_differs_only_in_its_last_character_is_refused(directory: TenantDirectory) -> None:
    refused(directory, f"Bearer {KEY[:-1]}{other_char(KEY[-1])}", "Invalid API key")


@pytest.mark.parametrize("kept", [3, 15, 16, 32, len(KEY) - 1])
def test_a_key_that_shares_only_a_prefix_is_refused(directory: TenantDirectory, kept: int) -> None:
    """Same first `kept` characters: a different rest, a truncated key, or the key with more after it."""
    different = KEY[:kept] + "".join(other_char(char) for char in KEY[kept:])
    for near in (different, KEY[:kept], KEY + "x", KEY + KEY[kept:]):
        refused(directory, f"Bearer {near}", "Invalid API key")


def test_a_key_that_differs_only_in_case_is_refused(directory: TenantDirectory) -> None:
    refused(directory, f"Bearer {KEY.upper()}", "Invalid API key")
    refused(directory, f"Bearer {KEY.lower()}", "Invalid API key")


def test_the_stored_hash_itself_is_not_a_key(directory: TenantDirectory) -> None:
    refused(directory, f"Bearer {hash_key(KEY)}", "Invalid API key")
    refused(directory, f"Bearer {hash_key(KEY).removeprefix('sha256:')}", "Invalid API key")


def test_a_key_whose_hash_shares_its_first_digits_with_a_real_one_is_refused(directory: TenantDirectory) -> None:
    # 4 hex digits match after about 65,000 tries (a few tens of milliseconds); each further digit costs 16 times as
    # many, so longer shared prefixes are built from the other side in the next test.
    target = hash_key(KEY)[: len("sha256:") + 4]
    near = next(f"bk-near-{n}" for n in count() if hash_key(f"bk-near-{n}").startswith(target))
    assert near != KEY
    refused(directory, f"Bearer {near}", "Invalid API key")


@pytest.mark.parametrize("shared", [8, 9, 25, 32, 63])
def test_a_stored_hash_that_shares_all_but_the_rest_of_its_digits_does_not_match(shared: int) -> None:
    """The directory only ever sees hashes: store one that equals the presented key's hash in its first `shared`
    hex digits and differs in every one after (no preimage needed). Comparing a prefix of the hashes, up to 63
    digits, would let the key in."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    near_hash = "sha256:" + digest[:shared] + "".join(HEX[(HEX.index(d) + 1) % 16] for d in digest[shared:])
    directory = TenantDirectory([TenantSettings(id="a", key_hashes=[near_hash])])
    refused(directory, f"Bearer {KEY}", "Invalid API key")


@pytest.mark.parametrize("authorization", [None, ""])
def test_a_missing_key_is_named_as_missing(directory: TenantDirectory, authorization: str | None) -> None:
    refused(directory, authorization, "Missing API key")


@pytest.mark.parametrize(
    "authorization",
    ["Bearer", "Bearer ", "Bearer    ", f"Basic {KEY}", f"Token {KEY}", f"Bearer:{KEY}", KEY, f" Bearer {KEY}"],
)
def test_a_malformed_header_is_named_as_malformed(directory: TenantDirectory, authorization: str) -> None:
    refused(directory, authorization, "Malformed Authorization header")


def names_used(code: CodeType) -> set[str]:
    """The global and attribute names a function uses, its nested comprehensions and lambdas included."""
    nested = (names_used(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def test_the_hashes_are_compared_in_constant_time() -> None:
    # Timing cannot be measured reliably in a unit test; what can be checked without patching anything is that the
    # comparison goes through hmac.compare_digest rather than ==.
    assert "compare_digest" in names_used(TenantDirectory.authenticate.__code__)

"""API-key authentication: only the exact key authenticates, never one that is merely close to it, whether close in
its own characters or in its SHA-256 hash; a missing or malformed Authorization header is told apart."""

from __future__ import annotations

import hashlib
from itertools import count
from types import CodeType

import pytest

from gateway.errors import AuthenticationFailed
from gateway.settings import TenantLimits, TenantSettings
from gateway.tenancy.tenants import TenantDirectory, checks_out, hash_key, new_api_key

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


async def refused(directory: TenantDirectory, authorization: str | None, message: str) -> None:
    with pytest.raises(AuthenticationFailed, match=message) as caught:
        await directory.authenticate(authorization)
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")


def other_char(char: str) -> str:
    return "A" if char != "A" else "B"


async def test_each_key_authenticates_as_its_own_tenant(directory: TenantDirectory) -> None:
    assert (await directory.authenticate(f"Bearer {KEY}")).id == "a"
    assert (await directory.authenticate(f"Bearer {OTHER_KEY}")).id == "a"
    assert (await directory.authenticate("Bearer bk-b-key")).id == "b"
    # The scheme is case-insensitive and the space around the key is not part of it.
    assert (await directory.authenticate(f"bearer   {KEY} ")).id == "a"


async def test_a_fresh_key_authenticates_through_its_hash() -> None:
    key = new_api_key()
    directory = TenantDirectory([TenantSettings(id="t", key_hashes=[hash_key(key)])])
    assert (await directory.authenticate(f"Bearer {key}")).id == "t"


async def test_a_key_that_differs_only_in_its_last_character_is_refused(directory: TenantDirectory) -> None:
    await refused(directory, f"Bearer {KEY[:-1]}{other_char(KEY[-1])}", "Invalid API key")


@pytest.mark.parametrize("kept", [3, 15, 16, 32, len(KEY) - 1])
async def test_a_key_that_shares_only_a_prefix_is_refused(directory: TenantDirectory, kept: int) -> None:
    """Same first `kept` characters: a different rest, a truncated key, or the key with more after it."""
    different = KEY[:kept] + "".join(other_char(char) for char in KEY[kept:])
    for near in (different, KEY[:kept], KEY + "x", KEY + KEY[kept:]):
        await refused(directory, f"Bearer {near}", "Invalid API key")


async def test_a_key_that_differs_only_in_case_is_refused(directory: TenantDirectory) -> None:
    await refused(directory, f"Bearer {KEY.upper()}", "Invalid API key")
    await refused(directory, f"Bearer {KEY.lower()}", "Invalid API key")


async def test_the_stored_hash_itself_is_not_a_key(directory: TenantDirectory) -> None:
    await refused(directory, f"Bearer {hash_key(KEY)}", "Invalid API key")
    await refused(directory, f"Bearer {hash_key(KEY).removeprefix('sha256:')}", "Invalid API key")


async def test_a_key_whose_hash_shares_its_first_digits_with_a_real_one_is_refused(directory: TenantDirectory) -> None:
    # 4 hex digits match after about 65,000 tries (a few tens of milliseconds); each further digit costs 16 times as
    # many, so longer shared prefixes are built from the other side in the next test.
    target = hash_key(KEY)[: len("sha256:") + 4]
    near = next(f"bk-near-{n}" for n in count() if hash_key(f"bk-near-{n}").startswith(target))
    assert near != KEY
    await refused(directory, f"Bearer {near}", "Invalid API key")


@pytest.mark.parametrize("shared", [8, 9, 25, 32, 63])
async def test_a_stored_hash_that_shares_all_but_the_rest_of_its_digits_does_not_match(shared: int) -> None:
    """The directory only ever sees hashes: store one that equals the presented key's hash in its first `shared`
    hex digits and differs in every one after (no preimage needed). Comparing a prefix of the hashes, up to 63
    digits, would let the key in."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    near_hash = "sha256:" + digest[:shared] + "".join(HEX[(HEX.index(d) + 1) % 16] for d in digest[shared:])
    directory = TenantDirectory([TenantSettings(id="a", key_hashes=[near_hash])])
    await refused(directory, f"Bearer {KEY}", "Invalid API key")


@pytest.mark.parametrize("authorization", [None, ""])
async def test_a_missing_key_is_named_as_missing(directory: TenantDirectory, authorization: str | None) -> None:
    await refused(directory, authorization, "Missing API key")


@pytest.mark.parametrize(
    "authorization",
    ["Bearer", "Bearer ", "Bearer    ", f"Basic {KEY}", f"Token {KEY}", f"Bearer:{KEY}", KEY, f" Bearer {KEY}"],
)
async def test_a_malformed_header_is_named_as_malformed(directory: TenantDirectory, authorization: str) -> None:
    await refused(directory, authorization, "Malformed Authorization header")


def names_used(code: CodeType) -> set[str]:
    """The global and attribute names a function uses, its nested comprehensions and lambdas included."""
    nested = (names_used(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def test_the_hashes_are_compared_in_constant_time() -> None:
    # Timing cannot be measured reliably in a unit test; what can be checked without patching anything is that the
    # comparison goes through hmac.compare_digest rather than ==.
    assert "compare_digest" in names_used(TenantDirectory.authenticate.__code__)


# --- keys made at runtime (the admin API): their check, and the same rules ---------------------------------------

SECRET = b"a check secret of thirty-two b.."


def test_a_runtime_key_ends_in_a_check_that_any_change_breaks() -> None:
    key = new_api_key(SECRET)
    assert key.startswith("bk-") and len(key) == len(new_api_key()) + 8 and checks_out(key, SECRET)
    for position in range(len("bk-"), len(key)):
        assert not checks_out(key[:position] + other_char(key[position]) + key[position + 1 :], SECRET), position
    assert not checks_out(key, SECRET[::-1]), "bound to the secret"
    for near in (key[:-1], key + "A", new_api_key(), KEY, "", "bk-"):
        assert not checks_out(near, SECRET)


def test_the_check_is_compared_in_constant_time() -> None:
    assert "compare_digest" in names_used(checks_out.__code__)


async def test_runtime_and_configured_keys_authenticate_side_by_side() -> None:
    """A directory with its check secret read still takes the settings' keys, which have no check."""
    directory = TenantDirectory([TenantSettings(id="a", key_hashes=[hash_key(KEY)])])
    await directory.start()
    await directory.create_tenant("r", ["*"], TenantLimits(), True)
    _, runtime_key = await directory.create_key("r", None, None)
    assert (await directory.authenticate(f"Bearer {KEY}")).id == "a"
    assert (await directory.authenticate(f"Bearer {runtime_key}")).id == "r"
    await refused(directory, f"Bearer {runtime_key[:-1]}{other_char(runtime_key[-1])}", "Invalid API key")
    await refused(directory, f"Bearer {hash_key(runtime_key)}", "Invalid API key")

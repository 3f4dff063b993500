"""Text a client decodes (escapes.py), read as the client reads it: JSON strings as a JSON parser does (once, or, a JSON
string holding JSON, up to DEPTH times), percent-encoding as `unquote`, character references as `html.unescape`, C
escapes as Python; the readings, and markers that only decoding spells out."""

from __future__ import annotations

import html
import json
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolation.escapes import DEPTH, END, EscapeLevels, EscapeReader, decode, opens_escape
from isolation.guard import Leak, LeakBlocked, StripWouldJoin
from isolation.leaks import REDACTED, LeakPolicy
from isolation.markers import MarkerRegistry, normal_form
from isolation.scanner import StreamScanner, normalize
from tests.unit.test_scanner import EPOCH, delta_chunk, guard_for, markers, pieces_of, registry_at, split
from tests.unit.test_scanner import relay_content as relay_with


def inside(text: str, ascii_only: bool) -> str:
    """`text` as it stands between the quotes of a JSON string."""
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1]


def read_in(pieces: list[str]) -> str:
    reader = EscapeReader()
    return "".join(reader.decoded(piece) for piece in pieces) + reader.end()


# Text with no `%` or `&`: JSON leaves those as they are, and a reading that decodes them too would differ.
PLAIN = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="%&"))


@settings(max_examples=120, deadline=None)
@given(PLAIN, st.booleans(), st.lists(st.integers(0, 400), max_size=20))
def test_a_json_string_reads_as_a_json_parser_reads_it_and_gives_an_output_per_character(
    text: str, ascii_only: bool, cuts: list[int]
) -> None:
    raw = inside(text, ascii_only)
    pieces = split(raw, [cut for cut in cuts if cut <= len(raw)])
    assert read_in(pieces) == text
    reader = EscapeReader()
    for piece in pieces:
        assert len(reader.read(piece)) == len(piece)
    assert not reader.pending


@settings(max_examples=120, deadline=None)
@given(st.text(), st.lists(st.integers(0, 400), max_size=20), st.sampled_from(["", "/?=&:"]))
def test_percent_encoding_reads_as_unquote_reads_it(text: str, cuts: list[int], safe: str) -> None:
    raw = urllib.parse.quote(text, safe=safe)
    assert read_in(split(raw, [cut for cut in cuts if cut <= len(raw)])) == urllib.parse.unquote(raw)


@settings(max_examples=120, deadline=None)
@given(st.text(st.characters(blacklist_characters="\\%")), st.lists(st.integers(0, 400), max_size=20))
def test_character_references_read_as_html_unescape_reads_them(text: str, cuts: list[int]) -> None:
    # Every character as a reference (named where HTML has a name, else numeric), and as html.escape writes text.
    for raw in ("".join(f"&#{ord(char)};" if i % 2 else f"&#x{ord(char):X}" for i, char in enumerate(text)),
                html.escape(text)):  # fmt: skip
        assert read_in(split(raw, [cut for cut in cuts if cut <= len(raw)])) == html.unescape(raw)


@pytest.mark.parametrize(
    ("raw", "read"),
    [
        ("a%20b a%2520b a&#32;b a&#x20;b a&nbsp;b a\\x20b a\\040b", "a b a%20b a b a b a\xa0b a b a b"),
        ("caf%C3%A9 caf\\xc3\\xa9 caf%E9 caf&eacute; caf&#233", "café café café café café"),
        ("&amp;lt; &ampx &notit; &lt", "&lt; &x ¬it; <"),
        ("50% off, R&D, %zz, &nope; &#; &#xZ %4g", "50% off, R&D, %zz, &nope; &#; &#xZ %4g"),
        ("a\\qb \\u00zz c \\12x", "aqb u00zz c \nx"),
        ("%63%6E%72%79 \\x63\\x6e \\143\\156 &#99;&#110;", "cnry cn cn cn"),
    ],
)
def test_each_kind_of_escape_and_what_is_no_escape(raw: str, read: str) -> None:
    assert decode(raw) == read
    # However the text is cut, and character by character.
    assert read_in(list(raw)) == read
    assert read_in([raw[:7], raw[7:19], raw[19:]]) == read


def test_a_surrogate_pair_is_one_character_at_its_end() -> None:
    reader = EscapeReader()
    assert reader.decoded("\\ud835") == "" and reader.pending  # half of a pair: nothing yet
    assert reader.decoded("\\udc02!") == "\U0001d402!"  # MATHEMATICAL BOLD CAPITAL C


def decoded(text: str, times: int) -> str:
    for _ in range(times):
        text = decode(text)
    return text


def streamed(text: str, times: int) -> str:
    for _ in range(times):
        text = EscapeReader().decoded(text)
    return text


@settings(max_examples=100, deadline=None)
@given(
    st.text(st.characters(codec="ascii")),
    st.lists(st.sampled_from(["json", "percent", "html"]), min_size=1, max_size=DEPTH),
    st.lists(st.integers(0, 400), max_size=20),
)
def test_each_level_reads_the_text_decoded_so_many_times_and_knows_where_each_character_began(
    text: str, encodings: list[str], cuts: list[int]
) -> None:
    raw = text
    for encoding in encodings:
        if encoding == "json":
            raw = inside(raw, True)
        elif encoding == "percent":
            raw = urllib.parse.quote(raw, safe="")
        else:
            raw = html.escape(raw)
    levels, shadows, begins = EscapeLevels(), [list[str]() for _ in range(DEPTH)], [list[int]() for _ in range(DEPTH)]
    raw += END  # it ends what an escape left open at the text's end, as `decode` does
    for piece in split(raw, [cut for cut in cuts if cut <= len(raw)]):
        for level, (shadow, began) in enumerate(levels.read(piece)):
            assert len(shadow) == len(piece) == len(began)
            shadows[level] += shadow
            begins[level] += began
    for level in range(DEPTH):  # (a level past the encodings may end inside an escape: `\\` decoded once is `\`)
        shadow = shadows[level]
        # In normal form (letters and digits), each reading is the text decoded level + 1 times.
        if level + 1 <= len(encodings):
            assert normalize("".join(shadow)) == normalize(decoded(raw, level + 1))
        for at, output in enumerate(shadow):
            # What the characters from where it began to where it stands decode to, decoded as often, is it (read as a
            # stream that goes on: an escape the last of them begins is not ended).
            if output and begins[level][at] < at:
                assert streamed(raw[begins[level][at] : at + 1], level + 1) == output


@pytest.mark.parametrize(
    ("text", "open_"),
    [
        ("ab\\u00", True), ("ab\\x4", True), ("ab\\1", True), ("ab%6", True), ("ab%", True),
        ("ab&am", True), ("ab&#", True), ("ab&#x4", True), ("x%C3", True), ("x%256", True), ("x\\\\u00", True),
        ("abc", False), ("50% ", False), ("a%20", False), ("R&D ", False), ("&lt;", False),
    ],
)  # fmt: skip
def test_what_ends_inside_an_escape_in_some_reading(text: str, open_: bool) -> None:
    # (`\\\\u00` is a backslash and `u00` as sent, and an open escape once decoded.)
    assert opens_escape(text) is open_


def escaped(marker: str, draw: st.DrawFn) -> str:
    """The marker as JSON text whose characters only decoding joins: escapes for letters, escaped controls between."""
    out = []
    for char in marker.replace("-", ""):
        form = draw(st.sampled_from(["plain", "unicode", "upper", "bold"]))
        if form == "unicode":
            out.append(f"\\u{ord(char):04x}")
        elif form == "upper":
            out.append(f"\\u{ord(char):04X}")
        elif form == "bold" and char.isalpha():
            bold = chr(0x1D400 + ord(char.upper()) - ord("A"))  # folded to the letter by NFKD, as the scanner does
            out.append(inside(bold, True))
        else:
            out.append(char)
        out.append(draw(st.sampled_from(["", "\\n", "\\t", "\\r\\n", "\\\\", "\\/"])))
    return "".join(out)


@st.composite
def escaped_streams(draw: st.DrawFn) -> tuple[str, bytes, list[str]]:
    """A marker in JSON text that decoding spells out once, twice or DEPTH times (a JSON string holding JSON)."""
    marker = draw(markers())
    text = inside(draw(st.text(max_size=30)), True) + escaped(marker, draw) + inside(draw(st.text(max_size=30)), True)
    for _ in range(draw(st.integers(1, DEPTH)) - 1):
        text = inside(text, True)
    pieces = list(text) if draw(st.booleans()) else split(text, draw(st.lists(st.integers(0, len(text)))))
    return text, normal_form(marker), pieces


@settings(max_examples=120, deadline=None)
@given(escaped_streams())
def test_a_marker_only_decoding_spells_is_found_whatever_the_chunking(case: tuple[str, bytes, list[str]]) -> None:
    text, normal, pieces = case
    scanner, before, found = StreamScanner(), "", False
    # The text's end, as the guard marks it: an escape still open there (`\\x` once decoded) is read as a decoder
    # reads one at a text's end.
    for piece in [*pieces, END]:
        scan = scanner.scan(piece)
        if normal in [hit.normal for hit in scan.hits]:
            found = True
            break
        before += scan.text[: scan.release]
    assert found
    # What went out before the scan that found it holds the marker neither as sent nor decoded, however often.
    assert all(normal not in normalize(decoded(before, times)) for times in range(DEPTH + 1))


async def relay_arguments(
    registry: MarkerRegistry, arguments: str, policy: LeakPolicy, pieces: list[str] | None = None
) -> tuple[str, list[Leak]]:
    """Stream tool-call arguments (in pieces of 5, or these pieces) and a closing chunk: what goes out, the leaks."""
    guard, leaks = guard_for(registry, policy)
    released = []
    for piece in pieces if pieces is not None else pieces_of(arguments, 5):
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"arguments": piece}}
        chunk = delta_chunk(tool_calls=[call])
        await guard.check_chunk(chunk)
        released.append(call["function"]["arguments"])
    closing = delta_chunk("tool_calls", tool_calls=[{"index": 0, "function": {"arguments": ""}}])
    await guard.check_chunk(closing)
    released.append(closing["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"])
    return "".join(released), leaks.found


@pytest.mark.parametrize("spelled", ["newline", "unicode"])
async def test_another_tenants_marker_in_escapes_is_blocked_and_redacted(spelled: str) -> None:
    registry = registry_at(tenants=("alice", "bob"))
    bobs = registry.marker("bob")
    hidden = bobs[:4] + "\\n" + bobs[5:] if spelled == "newline" else "".join(f"\\u{ord(c):04x}" for c in bobs)
    arguments = '{"note": "' + hidden + '"}'
    with pytest.raises(LeakBlocked):
        await relay_arguments(registry, arguments, LeakPolicy.BLOCK)
    redacted, leaks = await relay_arguments(registry, arguments, LeakPolicy.REDACT)
    assert leaks == [Leak("bob", "leak", str(EPOCH))]
    assert json.loads(redacted)["note"].endswith(REDACTED)
    assert normal_form(bobs) not in normalize(json.loads(redacted)["note"])
    if spelled == "unicode":  # a redaction takes whole escapes: what is left still parses
        assert redacted == '{"note": "' + REDACTED + '"}'

    # The tenant's own marker, spelled the same way, never reaches her whole (`CNRY\n…` as sent is the candidate
    # `cnryn…`, which overlaps hers: the part they share goes out with it, as with any overlapping candidates).
    mine = registry.marker("alice")
    own = mine[:4] + "\\n" + mine[5:] if spelled == "newline" else "".join(f"\\u{ord(c):04x}" for c in mine)
    released, leaks = await relay_arguments(registry, '{"note": "' + own + '"}', LeakPolicy.BLOCK)
    assert leaks == [] and normal_form(mine) not in normalize(json.loads(released)["note"])
    if spelled == "unicode":
        assert released == '{"note": ""}'


async def relay_content(registry: MarkerRegistry, text: str, size: int, policy: LeakPolicy) -> tuple[str, list[Leak]]:
    guard, leaks = guard_for(registry, policy)
    return await relay_with(guard, text, size), leaks.found


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("spelled", ["plain", "escaped"])
async def test_what_stripping_the_tenants_own_marker_joins_is_scanned_too(size: int, spelled: str) -> None:
    # `CN` + her own marker + `RY-<bob's code>` went out as bob's marker once hers was stripped, unseen.
    registry = registry_at(tenants=("alice", "bob"))
    mine, bobs = registry.marker("alice"), registry.marker("bob")
    if spelled == "plain":
        text = "x CN" + mine + "RY-" + bobs[5:] + " y"
    else:  # `\u00` + her marker + `43`: stripped, `\u0043` (C) and the rest spell bob's
        text = '{"note": "\\u00' + mine + "43NRY-" + bobs[5:] + '"}'
    if spelled == "escaped":
        # What follows the strip would complete an escape begun before it. Either no edit is tried (the answer is
        # withheld), or the strip takes the escape's start with her marker (a reading where `\u00c` + `n…` is no
        # escape reads it as its characters, from the backslash): what goes out spells neither marker, however read.
        for policy in (LeakPolicy.BLOCK, LeakPolicy.REDACT):
            try:
                out, _ = await relay_content(registry, text, size, policy)
            except StripWouldJoin:
                continue
            for times in range(DEPTH + 1):
                assert normal_form(mine) not in normalize(decoded(out, times)), out
                assert normal_form(bobs) not in normalize(decoded(out, times)), out
        return
    with pytest.raises(LeakBlocked):
        await relay_content(registry, text, size, LeakPolicy.BLOCK)
    out, leaks = await relay_content(registry, text, size, LeakPolicy.REDACT)
    assert leaks == [Leak("bob", "leak", str(EPOCH))]
    assert normal_form(bobs) not in normalize(out), out


async def test_an_escape_is_never_cut_by_a_hit_as_sent_that_ends_in_it() -> None:
    # `…\u` as sent ends a candidate (its last letter, the `u`): released, the escape's rest then completed her own
    # marker in what a client decodes.
    registry = registry_at(tenants=("alice", "bob"))
    mine = registry.marker("alice")
    pieces = ['{"note": "' + mine[:-1] + "\\u00", "41", '0041"}']
    released, leaks = await relay_arguments(registry, "".join(pieces), LeakPolicy.BLOCK, pieces)
    assert normal_form(mine) not in normalize(decode(released)), released
    assert leaks == []


@pytest.mark.parametrize("after", ["Y", "u0043NRY-{bob}"])
async def test_an_escaped_backslash_before_u_is_an_escape_once_decoded(after: str) -> None:
    # `\\u004` is a backslash and the text `u004` as sent, and `\u004` decoded once: an escape the next character
    # completes decoded twice (`\u004` + her marker + `3NRY…` would spell `CNRY…` there once she is stripped). A strip
    # there cannot be shown safe (what came before it may have gone out), whatever follows it.
    registry = registry_at(tenants=("alice", "bob"))
    mine, bobs = registry.marker("alice"), registry.marker("bob")
    arguments = '{"note": "X\\\\u004' + mine + after.format(bob=bobs[5:]) + '"}'
    with pytest.raises(StripWouldJoin):
        await relay_arguments(registry, arguments, LeakPolicy.BLOCK)
    with pytest.raises(StripWouldJoin):
        await relay_content(registry, arguments, 1000, LeakPolicy.BLOCK)
    # A backslash escaped more often than the scanner decodes (8 backslashes as sent for 16 in the JSON text) is a
    # backslash in every reading: the strip goes ahead.
    arguments = '{"note": "X' + "\\" * 16 + "u004" + mine + after.format(bob=bobs[5:]) + '"}'
    for released, leaks in (
        await relay_arguments(registry, arguments, LeakPolicy.BLOCK),
        await relay_content(registry, arguments, 1000, LeakPolicy.BLOCK),
    ):
        assert leaks == []
        note = json.loads(released)["note"]  # still parses
        assert normal_form(mine) not in normalize(note) and normal_form(bobs) not in normalize(note)


@pytest.mark.parametrize("field", ["content", "arguments"])
async def test_a_stream_cut_inside_the_tenants_own_marker_shows_none_of_it(field: str) -> None:
    # max_tokens can end an answer in the middle of a marker the model repeats: the held start of her own went out.
    registry = registry_at(tenants=("alice", "bob"))
    mine, bobs = registry.marker("alice"), registry.marker("bob")
    if field == "content":
        assert await relay_content(registry, "Note: " + mine[:15], 4, LeakPolicy.BLOCK) == ("Note: ", [])
        # The start of another tenant's is no secret of hers, and no leak: a tail that cannot become a marker.
        assert await relay_content(registry, "Note: " + bobs[:15], 4, LeakPolicy.BLOCK) == ("Note: " + bobs[:15], [])
    else:
        assert await relay_arguments(registry, '{"note": "' + mine[:12], LeakPolicy.BLOCK) == ('{"note": "', [])


@pytest.mark.parametrize(
    ("text", "cut"),
    [("C{alice}{bob1}", 2), ("CNR\\n{alice}Y{bob5}", 1), ("CNR\\n{alice}Y{bob5}", 3)],
)
async def test_a_strip_joins_with_what_went_out_in_earlier_chunks_too(text: str, cut: int) -> None:
    # The `C` (or `CNR\n`) went out a chunk before her marker; stripped, the rest spelled bob's marker, unseen.
    registry = registry_at(tenants=("alice", "bob"))
    mine, bobs = registry.marker("alice"), registry.marker("bob")
    answer = text.format(alice=mine, bob1=bobs[1:], bob5=bobs[5:])
    guard, leaks = guard_for(registry)
    with pytest.raises(LeakBlocked):
        for piece in [answer[:cut], *pieces_of(answer[cut:], cut)]:
            await guard.check_chunk(delta_chunk(content=piece))
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]

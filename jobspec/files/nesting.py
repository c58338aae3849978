"""How deep a run config's tables and arrays nest, measured without recursing: on TOML text
before tomllib reads it, and on the tables it read."""

from __future__ import annotations

import re
from collections.abc import Iterator

# TOML text as lexemes: strings and comments whole (what is in them never nests), bare words
# (keys, numbers, `=`), and the characters that change the nesting. Possessive quantifiers keep
# it linear. An unterminated string runs to its line's end (a multi-line one to the text's end):
# tomllib refuses it anyway. Up to two quotes after a multi-line string's closing three are its.
_LEXEME = re.compile(
    r'(?P<string>"""(?:[^"\\]++|\\.|"(?!""))*+(?:"""(?:""?)?)?'
    r"|'''(?:[^']++|'(?!''))*+(?:'''(?:''?)?)?"
    r'|"(?:[^"\\\n]++|\\.)*+"?'
    r"|'[^'\n]*+'?)"
    r"|(?P<comment>#[^\n]*+)"
    r"|(?P<word>[^\s\"'#\[\]{}.,]++)"
    r"|(?P<mark>[\[\]{}.,\n])",
    re.S,
)


def _marks(text: str) -> Iterator[tuple[str, int, bool]]:
    """(nesting character, position, whether only blanks precede it on its line), outside
    strings and comments."""
    blank = True
    for m in _LEXEME.finditer(text):
        kind = m.lastgroup
        if kind == "mark":
            mark = m.group()
            yield mark, m.start(), blank
            blank = mark == "\n"
        elif kind != "comment":
            blank = False


def deepest_line(text: str, limit: int) -> int | None:
    """The first line at which TOML `text` nests tables and arrays more than `limit` deep, the
    top-level table counting as one, or None. Dotted keys, [table] and [[array]] headers, arrays
    and inline tables all count. An estimate: a float's dot counts (one too many), and a header
    that goes through an earlier [[array]] counts that array's level once, not twice (the parsed
    tables are checked exactly by deepest_key).

    tomllib recurses per array or inline-table level, and its memory grows with the square of a
    dotted key's length (a 100 KB key took 10 GB), so this is checked before it reads the text."""
    header = 0  # levels that the current [table] header opens
    stack: list[int] = []  # the depth of each open array or inline table
    dots = 0  # dots since the key (or the header) began
    in_header, hdr_open, hdr_left = False, 0, 0
    for tok, at, blank in _marks(text):
        if in_header:
            if tok == "[":
                hdr_open, hdr_left = hdr_open + 1, hdr_left + 1
            elif tok == "]":
                hdr_left -= 1
                if hdr_left == 0:  # `[a.b]` opens a and b; `[[a.b]]` also b's array
                    in_header, header, dots = False, dots + hdr_open, 0
            elif tok == ".":
                dots += 1
            elif tok == "\n":  # a header left open: tomllib says so, the count stops here
                in_header, dots = False, 0
            depth = 1 + dots + hdr_open
        elif tok == "[" and not stack and blank:
            in_header, hdr_open, hdr_left, dots = True, 1, 1, 0
            depth = 2
        elif tok in "[{":
            stack.append((stack[-1] if stack else 1 + header) + dots + 1)
            dots, depth = 0, stack[-1]
        elif tok in "]}":
            if stack:
                stack.pop()
            dots, depth = 0, 0
        elif tok == ".":
            dots += 1
            depth = (stack[-1] if stack else 1 + header) + dots
        else:  # a comma starts a sibling; a line break ends a key = value outside brackets
            dots = 0 if tok == "," or not stack else dots
            depth = 0
        if depth > limit:
            return text.count("\n", 0, at) + 1
    return None


def deepest_key(data: object, limit: int) -> tuple[str | int, ...] | None:
    """The keys (indexes for arrays) down to the first table or array nested more than `limit`
    deep in `data`, the top level counting as one, or None. Iterative: the code it protects
    (pydantic, merge, the secret scan, tomli_w) recurses once per level."""
    # Each entry links to its parent's path, (key, parent link), not a copy: a wide table deep
    # down would otherwise hold a path per child.
    stack: list[tuple[dict | list, int, tuple | None]] = []
    if isinstance(data, dict | list):
        stack.append((data, 1, None))
    while stack:
        node, depth, link = stack.pop()
        if depth > limit:
            return _path(link)
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(value, dict | list):
                stack.append((value, depth + 1, (key, link)))
    return None


def _path(link: tuple | None) -> tuple[str | int, ...]:
    keys: list[str | int] = []
    while link is not None:
        key, link = link
        keys.append(key)
    return tuple(reversed(keys))

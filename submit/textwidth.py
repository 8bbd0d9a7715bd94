"""Text as a terminal and a file system see it: display width, escaped control characters, file-name slugs.

Stdlib only (unicodedata), so every side may use it. `len()` counts code points, but a
terminal gives East-Asian wide characters and most emoji two columns and combining marks
none, so tables padded with `len()` misalign on such names. Job names may hold any text;
run-dir names and error messages must stay readable and safe.
"""

from __future__ import annotations

import re
import unicodedata

_ZERO_WIDTH_CATEGORIES = ("Mn", "Me", "Cf", "Cc")
"""Combining marks (the accent of a decomposed 'é'), format characters (zero-width joiner), controls."""
_EMOJI_PRESENTATION = "\ufe0f"
"""VS16: the character before it is drawn as a (two-column) emoji, e.g. U+2764 U+FE0F."""

# Latin letters NFKD does not decompose into ASCII, spelled as people write them without the letter.
_LATIN_EXTRA = str.maketrans(
    {
        "ß": "ss",
        "æ": "ae",
        "Æ": "AE",
        "ø": "o",
        "Ø": "O",
        "œ": "oe",
        "Œ": "OE",
        "ł": "l",
        "Ł": "L",
        "đ": "d",
        "Đ": "D",
        "ð": "d",
        "Ð": "D",
        "þ": "th",
        "Þ": "Th",
        "ı": "i",
        "ŋ": "ng",
        "Ŋ": "Ng",
    }
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_+-]")
SLUG_MAX = 64
SLUG_FALLBACK = "job"


def char_width(char: str) -> int:
    """Columns one code point takes in a terminal: 0 (combining, format, control), 2 (wide) or 1."""
    if unicodedata.category(char) in _ZERO_WIDTH_CATEGORIES:
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def display_width(text: str) -> int:
    """Terminal columns of `text`: 'abc' -> 3, '模型' -> 4, 'e\\u0301' -> 1, '✨' -> 2, '❤\\ufe0f' -> 2.

    Emoji joined by U+200D (families, flags) are counted per part; terminals disagree on those.
    """
    width = 0
    for index, char in enumerate(text):
        if char == _EMOJI_PRESENTATION and index and char_width(text[index - 1]) == 1:
            width += 1  # the narrow symbol before it is drawn as a wide emoji
        else:
            width += char_width(char)
    return width


def ljust(text: str, width: int) -> str:
    """`text` padded with spaces to `width` terminal columns (str.ljust counts code points)."""
    return text + " " * max(0, width - display_width(text))


def rjust(text: str, width: int) -> str:
    """`text` right-aligned in `width` terminal columns."""
    return " " * max(0, width - display_width(text)) + text


def printable(text: str) -> str:
    """`text` with every non-printable character escaped ('\\x1b', '\\u202e', '\\n'): safe to print in one line."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def slug(name: str) -> str:
    """A readable, file-name-safe, never empty form of a job name: 'Über-Modell ✨' -> 'Uber-Modell'.

    Letters are transliterated to ASCII where Unicode can (NFKD without the accents, plus a few
    Latin letters it cannot); every other character outside [A-Za-z0-9_+-] becomes '_', and
    '_' is trimmed from the ends. Names with nothing transliterable (e.g. only CJK) become 'job'.
    """
    decomposed = unicodedata.normalize("NFKD", name.translate(_LATIN_EXTRA))
    ascii_text = "".join(char for char in decomposed if not unicodedata.combining(char))
    safe = _UNSAFE.sub("_", ascii_text)
    # A leading '-' would read as an option if the name is ever an argument on its own.
    return safe.strip("_").lstrip("-_")[:SLUG_MAX].rstrip("_") or SLUG_FALLBACK

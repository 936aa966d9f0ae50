"""Where a key of a TOML text is: the line of each dotted key, for error messages.

``tomllib`` gives values without positions, so an error found after parsing (a bad
type, an unknown key) could not name its line. :func:`key_lines` scans the text again
(it has already parsed, so the scanner assumes valid TOML and stays small): it records
the line of every table header (``[a.b]``, ``[[a]]``), every key of a key/value pair
(dotted keys ``a.b = 1`` and the keys inside inline tables ``{ x = 1 }`` included) and
every element of an array. :func:`line_of` then finds a path, or the nearest of its
parents that is written in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Path", "key_lines", "line_of", "show_path"]

#: a key's path: table and key names, and indices into arrays
Path = tuple[str | int, ...]

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}


class _Scanner:
    """One pass over a valid TOML text, recording each path's first line."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.lines: dict[Path, int] = {}
        #: how many tables each ``[[array]]`` has had so far
        self.arrays: dict[Path, int] = {}

    def line(self) -> int:
        return self.text.count("\n", 0, self.pos) + 1

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def record(self, path: Path) -> None:
        self.lines.setdefault(path, self.line())

    def skip_space(self, newlines: bool = False) -> None:
        """Skip blanks (and newlines and comments, if ``newlines``)."""
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#" and newlines:
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return

    def document(self) -> None:
        table: Path = ()
        while True:
            self.skip_space(newlines=True)
            if self.pos >= len(self.text):
                return
            if self.peek(2) == "[[":
                self.pos += 2
                name = self.key()
                index = self.arrays.get(name, 0)
                self.arrays[name] = index + 1
                self.record(name)
                table = (*name, index)
                self.record(table)
                self.pos = self.text.index("]]", self.pos) + 2
            elif self.peek() == "[":
                self.pos += 1
                table = self.key()
                self.record(table)
                self.pos = self.text.index("]", self.pos) + 1
            else:
                self.keyval(table)
            # the rest of the line is blank or a comment
            end = self.text.find("\n", self.pos)
            self.pos = len(self.text) if end < 0 else end

    def key(self) -> Path:
        """A dotted key, e.g. ``a."b c".d``, recording nothing."""
        parts: list[str | int] = []
        while True:
            self.skip_space()
            c = self.peek()
            if c in "\"'":
                parts.append(self.string())
            else:
                start = self.pos
                while self.pos < len(self.text) and self.text[self.pos] in _BARE:
                    self.pos += 1
                parts.append(self.text[start : self.pos])
            self.skip_space()
            if self.peek() != ".":
                return tuple(parts)
            self.pos += 1

    def keyval(self, table: Path) -> None:
        name = self.key()
        for n in range(1, len(name) + 1):  # a.b.c = 1 defines a, a.b and a.b.c here
            self.record((*table, *name[:n]))
        self.skip_space()
        self.pos += 1  # "="
        self.skip_space()
        self.value((*table, *name))

    def value(self, path: Path) -> None:
        c = self.peek()
        if c in "\"'":
            self.string()
        elif c == "[":
            self.array(path)
        elif c == "{":
            self.inline_table(path)
        else:  # a number, a boolean, a date: up to what ends a value
            while self.pos < len(self.text) and self.text[self.pos] not in ",]}#\r\n":
                self.pos += 1

    def array(self, path: Path) -> None:
        self.pos += 1
        index = 0
        while True:
            self.skip_space(newlines=True)
            if self.peek() == "]":
                self.pos += 1
                return
            if self.peek() == ",":
                self.pos += 1
                continue
            self.record((*path, index))
            self.value((*path, index))
            index += 1

    def inline_table(self, path: Path) -> None:
        self.pos += 1
        while True:
            self.skip_space(newlines=True)
            if self.peek() == "}":
                self.pos += 1
                return
            if self.peek() == ",":
                self.pos += 1
                continue
            self.keyval(path)

    def string(self) -> str:
        """A string of any of TOML's four kinds, as its value (escapes read)."""
        quote = self.peek()
        if self.peek(3) == quote * 3:
            self.pos += 3
            end = self.text.index(quote * 3, self.pos)
            while self.text[end + 3 : end + 4] == quote:  # up to two quotes end it
                end += 1
            raw, self.pos = self.text[self.pos : end], end + 3
            return raw
        self.pos += 1
        out: list[str] = []
        while True:
            c = self.text[self.pos]
            self.pos += 1
            if c == quote:
                return "".join(out)
            if c == "\\" and quote == '"':
                escape = self.text[self.pos]
                self.pos += 1
                if escape in "uU":
                    width = 4 if escape == "u" else 8
                    out.append(chr(int(self.text[self.pos : self.pos + width], 16)))
                    self.pos += width
                else:
                    out.append(_ESCAPES.get(escape, escape))
            else:
                out.append(c)


def key_lines(text: str) -> dict[Path, int]:
    """The line (from 1) where each path of the valid TOML ``text`` is first written.

    Args:
        text: a TOML document that ``tomllib`` parses.

    Returns:
        ``{path: line}`` for every table, key and array element written in it.
    """
    scanner = _Scanner(text)
    try:
        scanner.document()
    except (ValueError, IndexError):  # (not valid TOML after all: keep what was found)
        pass
    return scanner.lines


def line_of(lines: dict[Path, int], path: Sequence[str | int]) -> int:
    """The line of ``path``, else of its nearest parent written in the text, else 1."""
    at = tuple(path)
    while at:
        if at in lines:
            return lines[at]
        at = at[:-1]
    return 1


def show_path(path: Sequence[str | int]) -> str:
    """``targets.cluster.nodes``, ``dependencies[2]``: a path as an error names it."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            bare = part and all(c in _BARE for c in part)
            shown = part if bare else '"' + part.replace('"', '\\"') + '"'
            out += f".{shown}" if out else shown
    return out or "(the file)"

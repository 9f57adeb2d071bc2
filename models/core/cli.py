"""What the Hydra command lines (``python -m train``, ``python -m eval``) do to their arguments before Hydra reads
them."""

from __future__ import annotations

import re

# key=value, key as Hydra's override grammar spells it (+key, ++key, ~key, dotted, group@package)
_OVERRIDE = re.compile(r"^(\+{0,2}|~)[\w.@/-]+=")


def quote_non_ascii(argv: list[str]) -> list[str]:
    """``key=value`` with a non-ASCII value, unquoted, becomes ``key='value'``: Hydra's override lexer takes only
    ASCII in a bare value and would stop with a multi-line ``LexerNoViableAltException`` (``output_dir=runs/café``).
    A value that holds a quote, or is quoted already, is left as given (Hydra's own grammar then applies)."""
    out = []
    for a in argv:
        m = _OVERRIDE.match(a)
        value = a[m.end():] if m else ""
        if m and not value.isascii() and not any(q in value for q in "'\""):
            a = f"{a[:m.end()]}'{value}'"
        out.append(a)
    return out

"""``--data_reader_params``: ``"key=value;key=value"`` parsed once, for the job spec (which
validates it) and the readers (which take the dict)."""

from __future__ import annotations


def parse_reader_params(text: str | None) -> dict[str, str]:
    """Parse ``"key=value;key=value"`` into a dict; no evaluation of any kind.

    Keys are stripped of surrounding blanks, values are kept as written (so ``sep= `` means a
    space); empty pieces (``"a=1;"``) are ignored. The value may contain ``=``.

    Raises:
        ValueError: a piece without ``=``, with an empty key, or a repeated key.
    """
    params: dict[str, str] = {}
    if not text:
        return params
    for piece in text.split(";"):
        if not piece.strip():
            continue
        key, eq, value = piece.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"malformed reader parameter {piece!r}: expected key=value")
        if key in params:
            raise ValueError(f"reader parameter {key!r} given twice")
        params[key] = value
    return params

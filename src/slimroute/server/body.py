"""A classify request's body, read as the schema promises: `Content-Type: application/json` (else 415), then UTF-8
JSON (else 422 `invalid_request` naming the byte or character at fault), then one of the request shapes (422).

Python's `json` alone would take UTF-16 and UTF-32 bodies (it guesses the encoding of bytes), `NaN` and `Infinity`,
and fail outside the error shape on a body nested thousands deep (RecursionError) or a number of thousands of digits
(ValueError); each of those is a 422 here, found before any text reaches the model.
"""

from __future__ import annotations

import codecs
import json
from email.message import Message
from typing import Any

from slimroute.server.schemas import ApiError, RequestInvalid

MAX_NUMBER_DIGITS = 20  # an integer id fits in 19 digits and a sign; longer numbers are refused while parsing


def check_media_type(content_type: str | None) -> None:
    """415 unless the body is declared `application/json` (a `charset`, if given, must be utf-8)."""
    if content_type is None:
        raise ApiError(415, "unsupported_media_type", "the request has no Content-Type; send the body as JSON with "
                       "'Content-Type: application/json'", "content-type")
    header = Message()
    header["content-type"] = content_type
    media_type, charset = header.get_content_type(), header.get_param("charset")
    if media_type != "application/json" or (charset is not None and str(charset).lower() not in ("utf-8", "utf8")):
        shown = content_type if len(content_type) <= 100 else content_type[:100] + "..."
        raise ApiError(415, "unsupported_media_type", f"the body must be UTF-8 JSON with 'Content-Type: "
                       f"application/json', not {shown!r}", "content-type")


def parse_json(body: bytes) -> Any:
    """The body's JSON value; RequestInvalid (a 422 on the field 'body') when it is not UTF-8 JSON."""
    if not body:
        raise _invalid("the body is empty; send a JSON object with 'text' or 'texts'")
    if body.startswith(codecs.BOM_UTF8):
        raise _invalid("the body starts with a byte-order mark (U+FEFF); send JSON without one")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the body is not UTF-8 (byte 0x{body[exc.start]:02x} at position {exc.start}); send JSON "
                       f"encoded as UTF-8") from None
    try:
        return json.loads(text, parse_int=_integer, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise _invalid(f"malformed JSON at character {exc.pos}: {exc.msg}") from None
    except RecursionError:
        raise _invalid("the JSON nests too deeply; a request is an object of strings and lists of them") from None


def _integer(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS - 1:
        raise _invalid(f"a number in the body has {len(digits.lstrip('-'))} digits; an integer id has at most "
                       f"{MAX_NUMBER_DIGITS - 1}")
    return int(digits)


def _no_constant(name: str):
    raise _invalid(f"{name} is not JSON; a request holds strings (and integer ids)")


def _invalid(message: str) -> RequestInvalid:
    return RequestInvalid([("body", message)])

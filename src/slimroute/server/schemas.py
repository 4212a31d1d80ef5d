"""The service's bodies (pydantic models, which the OpenAPI schema is generated from) and its one error shape:
`{"error": {"type", "message", "field", "request_id"}}` (a 422 adds `details`, one per problem).

A request is one text (`{"text", "id"}`) or several (`{"texts", "ids"}`); `request_models(max_texts, max_text_chars)`
builds both shapes with the server's limits in them, so that what the schema admits is exactly what the server takes
by its shape: at most that many texts, each at most that many characters, holding a visible character and no lone
UTF-16 surrogate, and as many ids as texts. What JSON Schema cannot say (tokens per text, bytes per body) is a 413.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, WithJsonSchema

# Characters that show nothing: whitespace, control characters, and the Basic Multilingual Plane's format characters
# (zero-width spaces and joiners, direction marks, the byte-order mark, the soft hyphen; Unicode 14). A text needs one
# character outside them. Written out, not computed, so the schema does not change with Python's Unicode version;
# \uXXXX escapes read the same in Python's `re` and in ECMA-262 (JSON Schema's regex dialect).
INVISIBLE = (r"\u0000-\u0020\u007F-\u00A0\u00AD\u0600-\u0605\u061C\u06DD\u070F\u0890-\u0891\u08E2\u1680\u180E"
             r"\u2000-\u200F\u2028-\u202F\u205F-\u2064\u2066-\u206F\u3000\uFEFF\uFFF9-\uFFFB")
VISIBLE_PATTERN = f"[^{INVISIBLE}]"
_VISIBLE = re.compile(VISIBLE_PATTERN)
ID_RANGE = (-(2**63), 2**63 - 1)  # integer ids: what a signed 64-bit integer holds


def _valid_unicode(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X} at character {exc.start}); "
                         f"send valid Unicode") from None


def check_text(text: str) -> str:
    _valid_unicode(text)
    if _VISIBLE.search(text) is None:
        raise ValueError("text is empty or has no visible character (only whitespace, control or format characters)")
    return text


def check_id(value: Any) -> str | int:
    """A string of valid Unicode, or an integer in ID_RANGE; a number with an integral value (9472.0) is that integer,
    as JSON Schema's "integer" says (its answer's id is 9472)."""
    if isinstance(value, str):
        _valid_unicode(value)
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and ID_RANGE[0] <= value <= ID_RANGE[1]:
        return value
    raise ValueError("an id is a string or an integer between -2^63 and 2^63-1")


def check_optional_id(value: Any) -> str | int | None:
    return None if value is None else check_id(value)


_ID_SCHEMA = [{"type": "string"}, {"type": "integer", "minimum": ID_RANGE[0], "maximum": ID_RANGE[1]}]
ItemId = Annotated[str | int, PlainValidator(check_id), WithJsonSchema({"anyOf": _ID_SCHEMA})]
OptionalItemId = Annotated[str | int | None, PlainValidator(check_optional_id),
                           WithJsonSchema({"anyOf": [*_ID_SCHEMA, {"type": "null"}]})]


class OneText(BaseModel):
    """One text, with an optional id echoed in its result."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def items(self) -> tuple[list[str], list[str | int | None]]:
        return [self.text], [self.id]


class ManyTexts(BaseModel):
    """Texts, with optional ids (as many as texts), answered in their order."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def items(self) -> tuple[list[str], list[str | int | None]]:
        return list(self.texts), list(self.ids) if self.ids is not None else [None] * len(self.texts)


def request_models(max_texts: int, max_text_chars: int) -> tuple[type[OneText], type[ManyTexts]]:
    """The two request shapes with these limits (each server's schema states its own)."""
    text_schema = {"type": "string", "maxLength": max_text_chars, "pattern": VISIBLE_PATTERN}
    Text = Annotated[str, PlainValidator(lambda v: check_text(_string(v))), WithJsonSchema(text_schema)]

    def ids_as_many_as_texts(schema: dict) -> None:  # JSON Schema has no "as long as": one branch per length
        schema["anyOf"] = [{"properties": {"ids": {"type": "null"}}}] + [
            {"properties": {"texts": {"minItems": n, "maxItems": n}, "ids": {"minItems": n, "maxItems": n}}}
            for n in range(1, max_texts + 1)]

    class One(OneText):
        __doc__ = OneText.__doc__
        model_config = ConfigDict(title="OneText")
        text: Annotated[Text, Field(examples=["I was charged twice this month"])]
        id: OptionalItemId = None

    class Many(ManyTexts):
        __doc__ = ManyTexts.__doc__
        model_config = ConfigDict(title="ManyTexts", json_schema_extra=ids_as_many_as_texts)
        texts: Annotated[list[Text], Field(min_length=1, max_length=max_texts,
                                           examples=[["I was charged twice", "App crashes"]])]
        ids: list[ItemId] | None = None

    def _string(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError("Input should be a valid string")
        if len(value) > max_text_chars:
            raise ValueError(f"has {len(value)} characters; the limit is {max_text_chars} characters per text")
        return value

    return One, Many


class RequestInvalid(Exception):
    """A body that is JSON but not a request: the problems as (field, message), first one first."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__(problems[0][1])
        self.problems = problems


def parse_request(data: Any, models: tuple[type[OneText], type[ManyTexts]]) -> OneText | ManyTexts:
    if not isinstance(data, dict):
        raise RequestInvalid([("body", f"the body must be a JSON object with 'text' or 'texts', not "
                                       f"{_json_type(data)}")])
    if ("text" in data) == ("texts" in data):
        raise RequestInvalid([("body", "give exactly one of 'text' (one string) or 'texts' (a list of strings)")])
    model = models[0] if "text" in data else models[1]
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise RequestInvalid([describe(e) for e in exc.errors(include_url=False)]) from None
    if isinstance(request, ManyTexts) and request.ids is not None and len(request.ids) != len(request.texts):
        raise RequestInvalid([("ids", f"got {len(request.ids)} ids for {len(request.texts)} texts; give one id "
                                      f"per text")])
    return request


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def field_name(loc) -> str:
    """('texts', 2) -> 'texts[2]'; () -> 'body'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def describe(error: dict) -> tuple[str, str]:
    """A pydantic error as (field, message), the message naming the limit broken."""
    field, kind, ctx = field_name(error.get("loc", ())), error.get("type"), error.get("ctx") or {}
    if kind == "too_long" and field == "texts":
        num, limit = ctx.get("actual_length"), ctx.get("max_length")
        return field, f"the request has {num} texts; the limit is {limit} per request"
    if kind == "too_short" and field == "texts":
        return field, "texts must hold at least 1 text"
    if kind == "extra_forbidden":
        return field, "Extra inputs are not permitted: a request holds 'text' and 'id', or 'texts' and 'ids'"
    return field, error.get("msg", "invalid").removeprefix("Value error, ")


# ---------------------------------------------------------------------------------------------------- answers


class ItemResult(BaseModel):
    id: str | int | None
    label: str  # the answer: the fallback label when the server's floor (--min-prob) routed the text there
    model_label: str  # the decision's own choice (equal to label unless routed)
    probs: dict[str, float]  # renormalised over the labels
    logprobs: dict[str, float]  # exact log-probability of each label's tokens
    calibrated_logprobs: dict[str, float] | None = None  # with calibration: logprobs minus offsets (probs use them)
    num_tokens: int
    truncated: bool


class Timing(BaseModel):
    queue_ms: float  # from arrival to the start of the first engine call that holds one of its texts
    engine_ms: float  # from then until its last text was answered (other requests' turns included)
    total_ms: float  # request received -> response built
    batch_items: int  # texts in the engine call that answered its last text, this request's included
    batch_requests: int


class ClassifyResponse(BaseModel):
    task: str
    results: list[ItemResult]
    timing: Timing


class Health(BaseModel):
    status: Literal["ok"]
    dtype: str | None
    dtype_reason: str | None


class Readiness(BaseModel):
    status: Literal["ready", "loading", "failed", "stopping"]
    tasks: list[str] | None = None  # when ready
    error: str | None = None  # when failed


class Fallback(BaseModel):
    min_prob: float
    label: str


class TaskInfo(BaseModel):
    name: str
    labels: list[str]
    instructions: str | None
    descriptions: dict[str, str]
    num_examples: int
    truncate_tokens: int | None
    prefix_tokens: int | None
    calibration: dict[str, Any] | None
    fallback: Fallback | None
    default: bool


class Limits(BaseModel):
    max_texts: int
    max_text_chars: int
    max_body_bytes: int
    max_text_tokens: int | None
    max_queue_items: int
    read_timeout_s: float


class Info(BaseModel):
    model: str | None
    dtype: str | None
    dtype_reason: str | None
    ready: bool
    default_task: str | None
    tasks: list[TaskInfo]
    limits: Limits


class ErrorDetail(BaseModel):
    field: str
    message: str


class Error(BaseModel):
    type: str  # invalid_request, unauthorized, unknown_task, text_too_long, ... (docs/server.md)
    message: str  # what went wrong and what to do
    field: str | None  # the part of the request at fault: body, text, texts[3], ids, content-type, ...
    request_id: str  # also the X-Request-ID header, and in the server's log line
    details: list[ErrorDetail] | None = None  # 422: every problem found


class ErrorBody(BaseModel):
    error: Error


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, field: str | None = None, headers=None, details=None):
        super().__init__(message)
        self.status, self.kind, self.message, self.field, self.headers = status, kind, message, field, headers
        self.details = details


def error_response(status: int, kind: str, message: str, field: str | None, request_id: str, headers=None,
                   details: list[dict] | None = None) -> JSONResponse:
    body = {"type": kind, "message": message, "field": field, "request_id": request_id}
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status, headers=headers)

"""The service's request and response bodies (pydantic models, which the OpenAPI schema is generated from), and its
one error shape: `{"error": {"type", "message", "field"}}`."""

from __future__ import annotations

from typing import Annotated

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("text is empty or only whitespace")
    return text


Text = Annotated[str, AfterValidator(_not_blank)]
ItemId = str | int


class ClassifyRequest(BaseModel):
    """Either `texts` (with optional `ids`, one per text) or a single `text` (with optional `id`)."""

    model_config = ConfigDict(extra="forbid")
    texts: list[Text] | None = Field(None, min_length=1, examples=[["I was charged twice", "App crashes"]])
    ids: list[ItemId] | None = None
    text: Text | None = Field(None, examples=["I was charged twice this month"])
    id: ItemId | None = None

    @field_validator("ids")
    @classmethod
    def _ids_match_texts(cls, ids, info: ValidationInfo):
        texts = info.data.get("texts")
        if ids is not None and texts is not None and len(ids) != len(texts):
            raise ValueError(f"got {len(ids)} ids for {len(texts)} texts; give one id per text")
        return ids

    @model_validator(mode="after")
    def _one_input(self):
        if (self.texts is None) == (self.text is None):
            raise ValueError("give exactly one of 'text' (one string) or 'texts' (a list of strings)")
        if self.texts is not None and self.id is not None:
            raise ValueError("'id' goes with 'text'; with 'texts' use 'ids'")
        if self.text is not None and self.ids is not None:
            raise ValueError("'ids' goes with 'texts'; with 'text' use 'id'")
        return self

    def items(self) -> tuple[list[str], list[ItemId | None]]:
        if self.text is not None:
            return [self.text], [self.id]
        return list(self.texts), list(self.ids) if self.ids is not None else [None] * len(self.texts)


class ItemResult(BaseModel):
    id: ItemId | None
    label: str  # the answer: the fallback label when the server's floor (--min-prob) routed the text there
    model_label: str  # the decision's own choice (equal to label unless routed)
    probs: dict[str, float]  # renormalised over the labels
    logprobs: dict[str, float]  # exact log-probability of each label's tokens
    calibrated_logprobs: dict[str, float] | None = None  # with calibration: logprobs minus offsets (probs use them)
    num_tokens: int
    truncated: bool


class Timing(BaseModel):
    queue_ms: float  # waiting for the worker and the batch to fill
    engine_ms: float  # the engine call that answered this request
    total_ms: float  # request received -> response built
    batch_items: int  # texts in that engine call, this request's included
    batch_requests: int


class ClassifyResponse(BaseModel):
    task: str
    results: list[ItemResult]
    timing: Timing


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, field: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.kind, self.message, self.field, self.headers = status, kind, message, field, headers


def error_response(status: int, kind: str, message: str, field: str | None = None, headers=None, **extra):
    body = {"error": {"type": kind, "message": message, "field": field, **extra}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_name(loc) -> str:
    """('body', 'texts', 2) -> 'texts[2]'; ('body',) -> 'body'."""
    parts = [p for p in loc if p != "body"] if len(loc) > 1 else list(loc)
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def describe(error: dict) -> tuple[str, str]:
    if error.get("type") == "json_invalid":
        pos = error["loc"][1] if len(error["loc"]) > 1 else "?"
        return "body", f"malformed JSON at character {pos}: {error.get('ctx', {}).get('error', 'invalid')}"
    message = error.get("msg", "invalid").removeprefix("Value error, ")
    return field_name(error.get("loc", ("body",))), message

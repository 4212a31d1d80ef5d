"""Talk to `slimroute serve` from Python.

    from slimroute.backends.remote import RemoteClassifier
    with RemoteClassifier("http://127.0.0.1:8000") as clf:
        preds = clf.classify(["I was charged twice", "The app crashes"])  # like Engine.classify

`RemoteClassifier.classify` sends the texts in chunks (a few in flight, so the server's batches
stay full), waits out 503 + Retry-After, and returns `Prediction`s in input order. A 4xx/5xx answer
raises `ServerError` with the server's message; `local.classify_rows` then retries row by row, so
only the offending rows become row errors. A server started with API keys needs `api_key=` (default:
the first key in $SLIMROUTE_API_KEY); a refused key raises `AccessDenied`, a ValueError.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from slimroute.labels import Fallback, Prediction


class ServerError(RuntimeError):
    """A 4xx/5xx answer in the server's error shape: status, message, the field at fault, the request id its log
    line carries."""

    def __init__(self, status: int, message: str, field: str | None = None, request_id: str | None = None):
        super().__init__(f"server answered {status}: {message}")  # no request id: row errors stay the same per run
        self.status, self.message, self.field, self.request_id = status, message, field, request_id


class ServerUnreachable(ValueError):
    """No answer from the server's address (a usage error for `classify --server URL`)."""


class AccessDenied(ValueError):
    """The server refused the API key, or asked for one (401/403): a usage error too."""


def key_from_env() -> str | None:
    """The first key in $SLIMROUTE_API_KEY (the server accepts a comma-separated list there)."""
    keys = [k.strip() for k in os.environ.get("SLIMROUTE_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


def classify_path(task_name: str | None) -> str:
    return "/v1/classify" if task_name is None else f"/v1/tasks/{task_name}/classify"


def to_prediction(item: dict) -> Prediction:
    logprobs = dict(item["logprobs"])
    calibrated = item.get("calibrated_logprobs")
    return Prediction(item["label"], logprobs, item.get("num_tokens", 0), item.get("truncated", False),
                      calibrated_logprobs=dict(calibrated) if calibrated is not None else None,
                      model_label=item.get("model_label"))


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = response.json()["error"]
        message, field = error.get("message", response.text), error.get("field")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, field = response.text or response.reason_phrase, None
    if response.status_code in (401, 403):
        raise AccessDenied(f"the server refused the request ({response.status_code}): {message}")
    raise ServerError(response.status_code, message, field, response.headers.get("x-request-id"))


def retry_delay(response: httpx.Response, default: float = 1.0) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", default)))
    except ValueError:
        return default


class RemoteClassifier:
    """A classifier (`.classify(texts, progress=None) -> list[Prediction]`) backed by a running server."""

    def __init__(
        self, url: str, task_name: str | None = None, chunk_size: int = 64, concurrency: int = 2,
        timeout: float = 600.0, max_busy_retries: int = 30, client: httpx.Client | None = None,
        api_key: str | None = None,
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url, self.task_name = url.rstrip("/"), task_name
        self.chunk_size, self.concurrency, self.max_busy_retries = chunk_size, concurrency, max_busy_retries
        self._client = client or httpx.Client(base_url=self.url, timeout=timeout)
        self._owns_client = client is None
        self._info: dict | None = None
        api_key = api_key or key_from_env()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __enter__(self) -> RemoteClassifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def info(self) -> dict:
        """GET /v1/info: tasks, labels, limits (fetched once)."""
        if self._info is None:
            try:
                response = self._client.get("/v1/info", headers=self._headers)
            except httpx.TransportError as exc:
                raise ServerUnreachable(f"no slimroute server answers at {self.url}: {exc}") from exc
            raise_for_error(response)
            self._info = response.json()
        return self._info

    def task_info(self) -> dict:
        info = self.info()
        name = self.task_name or info["default_task"]
        for task in info["tasks"]:
            if task["name"] == name:
                return task
        raise ValueError(f"task {name!r} is not served at {self.url}; served: {[t['name'] for t in info['tasks']]}")

    def fallback(self) -> Fallback | None:
        """The served task's fallback floor (serve --min-prob), or None."""
        floor = self.task_info().get("fallback")
        return Fallback(floor["min_prob"], floor["label"]) if floor else None

    def answer_settings(self) -> dict:
        """What decides the served task's answers: the server's model and dtype, and the task's prompt, calibration
        and fallback floor. A job records it (jobs.job_settings), so it resumes only against a server that answers
        as the one it began with (not one restarted with another floor, model or calibration)."""
        info, task = self.info(), self.task_info()
        keys = ("labels", "instructions", "descriptions", "num_examples", "prefix_tokens", "calibration", "fallback")
        cut = {"truncate_tokens": task["truncate_tokens"]} if task.get("truncate_tokens") else {}  # absent: as before
        return {"model": info.get("model"), "dtype": info.get("dtype"), **{key: task.get(key) for key in keys}, **cut}

    def labels(self) -> tuple[str, ...]:
        """The task's labels, in the server's order."""
        return tuple(self.task_info()["labels"])

    def classify(self, texts: list[str], progress: Callable[[int], None] | None = None) -> list[Prediction]:
        size = min(self.chunk_size, self.info()["limits"]["max_texts"])
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        predictions: list[Prediction] = []

        def take(future) -> None:
            answer = future.result()
            predictions.extend(answer)
            if progress:
                progress(len(answer))

        in_flight: deque = deque()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="slimroute-client") as pool:
            try:
                for chunk in chunks:
                    in_flight.append(pool.submit(self.classify_chunk, chunk))
                    if len(in_flight) >= self.concurrency:
                        take(in_flight.popleft())
                while in_flight:
                    take(in_flight.popleft())
            except BaseException:
                for future in in_flight:
                    future.cancel()
                raise
        return predictions

    def classify_chunk(self, texts: list[str]) -> list[Prediction]:
        """One request; waits and retries while the server answers 503 (or, 3 times, does not answer)."""
        if not texts:
            return []
        unreachable = 0
        for _ in range(self.max_busy_retries + 1):
            try:
                response = self._client.post(classify_path(self.task_name), json={"texts": list(texts)},
                                             headers=self._headers)
            except httpx.TransportError as exc:
                unreachable += 1
                if unreachable > 3:
                    raise ServerUnreachable(f"no answer from the server at {self.url}: {exc}") from exc
                time.sleep(1.0)
                continue
            if response.status_code != 503:
                break
            time.sleep(retry_delay(response))
        raise_for_error(response)
        return [to_prediction(item) for item in response.json()["results"]]

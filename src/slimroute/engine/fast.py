"""Engine.classify(texts): the one hot loop. No logging, HTTP or Ray in here.

Per batch: right-padded item ids run behind the cached prompt prefix (positions continue after it), the hidden state
at each item's last real token (the last layer's MLP runs on those rows alone) is scored against the label tokens'
head rows, and the multi-token labels' continuations in extra batched passes behind the batch's keys, which they leave
unchanged (labels share a pass, each on its own copy of the batch's rows). With a tuned head that same hidden state
goes through the head instead; `features` hands the head's inputs out for tuning. The decision (offsets, rule, floor)
is the TaskSetup's, exactly as in the reference. The forward passes themselves are passes.py's (the model's own
forward, or its fused int8 decoder).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from slimroute.accuracy.head import head_features, item_states, label_totals
from slimroute.config import EngineConfig
from slimroute.engine.batching import PaddingStats, pad_right, plan_batches
from slimroute.engine.passes import passes_for
from slimroute.engine.prefix_cache import smallest_window
from slimroute.engine.reference import ReferenceClassifier
from slimroute.engine.scoring import LabelScorer, check_scorer
from slimroute.engine.setup import Classifier, TaskSetup
from slimroute.labels import Prediction, continuation_runs
from slimroute.runtime.memory import return_freed_memory
from slimroute.runtime.threads import warm_up_vector_math
from slimroute.task import Task

SCORER_ROWS = 64  # rows per label-scorer call, gathered over small batches: its vocabulary-wide GEMM reads the whole
# output head once per call, and never more rows than this go in at once (each row's logits are 0.6 MB)
CONTINUATION_ROW_KEYS = 8192  # multi-token labels share a continuation pass while its rows x keys stay within this
# (larger passes' copies of keys and values outgrow the CPU's caches: docs/design.md)


@dataclass
class EngineStats:
    num_items: int = 0
    num_batches: int = 0
    num_truncated: int = 0
    num_rechecked: int = 0  # near-ties re-decided by the exact one-at-a-time path
    seconds: float = 0.0
    padding: PaddingStats = field(default_factory=PaddingStats)

    def merge(self, other: EngineStats) -> None:
        self.num_items += other.num_items
        self.num_batches += other.num_batches
        self.num_truncated += other.num_truncated
        self.num_rechecked += other.num_rechecked
        self.seconds += other.seconds
        self.padding.merge(other.padding)


class Engine(Classifier):
    def __init__(self, model, tokenizer, task: Task, config: EngineConfig | None = None, max_positions=None,
                 recheck=None, head=None, calibration=None):
        """recheck: a callable text -> Prediction used for near-ties when config.recheck_margin is set (default: the
        reference's classify_one). head: a tuned Head that decides instead of the label tokens; it must have been
        tuned on this model, tokenizer and task (else HeadMismatchError). calibration: accuracy.calibration.Offsets
        subtracted from the label log-probs before the decision (not with a head: ValueError)."""
        config = config or EngineConfig()
        max_positions = max_positions or int(getattr(model.config, "max_position_embeddings", 32768))
        super().__init__(model, tokenizer, TaskSetup.build(model, tokenizer, task, config.decision, max_positions,
                                                           head, calibration, config.fallback))
        self.config, self.max_positions = config, max_positions
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.device = next(model.parameters()).device
        # the multi-token labels' contexts (each fed once, however many labels share it) and the runs that feed them
        self._runs, where = continuation_runs(self.label_ids)  # where: each context's (run, position) in the runs
        self._context_states = list(where.values())
        self._context_index = {context: i for i, context in enumerate(where)}
        self.scorer = LabelScorer(model.get_output_embeddings(), [t for ids in self.label_ids for t in ids],
                                  model.config)
        warm_up_vector_math()  # a model built without load_model: its first pass must round like every later one
        check_scorer(model, self.scorer, self.prompt.prefix_ids[-8:] or [self.pad_id])
        self.passes = passes_for(model, self.prompt.prefix_ids if config.prefix_cache else None)
        self._window = smallest_window(model.config)  # None: no sliding-window layer
        self.stats = EngineStats()  # totals over the engine's life
        self.last_stats = EngineStats()  # the last classify call's
        self._given_recheck = recheck
        self.recheck = self._recheck()

    @classmethod
    def from_loaded(cls, loaded, task: Task, config: EngineConfig | None = None, head=None,
                    calibration=None) -> Engine:
        return cls(loaded.model, loaded.tokenizer, task, config, loaded.max_positions, head=head,
                   calibration=calibration)

    def with_task(self, task: Task, head=None) -> Engine:
        """This engine's model, tokenizer and settings on another task (another prompt: its own prefix cache)."""
        return Engine(self.model, self.tokenizer, task, self.config, self.max_positions, head=head)

    def _recheck(self) -> Callable[[str], Prediction] | None:
        if self.config.recheck_margin is None or self._given_recheck is not None:
            return self._given_recheck
        return ReferenceClassifier.from_setup(self.model, self.tokenizer, self.setup).classify_one

    def with_calibration(self, offsets) -> Engine:
        """This engine (model, prefix cache, running stats shared) deciding with `offsets`."""
        engine = super().with_calibration(offsets)
        engine.recheck = engine._recheck()  # the reference recheck decides with the same offsets
        return engine

    def encode(self, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
        fitted = [self.prompt.fit_text(t) for t in texts]
        item_ids = self.prompt.item_ids_batch([text for text, _ in fitted])
        if not self.config.prefix_cache:
            item_ids = [self.prompt.prefix_ids + ids for ids in item_ids]
        return item_ids, [truncated for _, truncated in fitted]

    def classify(self, texts: list[str], progress=None, on_results=None) -> list[Prediction]:
        """Predictions in input order. Texts must be non-empty strings (see backends.local.classify_rows).

        progress(num_items) and on_results([(index, prediction), ...]) are called after each batch, so a caller (the
        server) can hand out answers before the last batch is done."""
        results: list[Prediction | None] = [None] * len(texts)
        for groups in self._steps(texts, progress):
            for done in groups:  # one batch's answers at a time, as soon as it is decided
                for i, prediction in done:
                    results[i] = prediction
                if on_results:
                    on_results(done)
        return results

    def steps(self, texts: list[str], progress=None) -> Iterator[list[tuple[int, Prediction]]]:
        """classify(texts) one forward pass at a time: each step runs one batch, or one chunk of a long item
        (config.chunk_tokens), and yields the [(index, prediction)] it finished (often none: decisions wait for a
        shared scorer call). A caller can run other work between steps (the server interleaves requests so);
        last_stats is set once the last step is taken. A failing batch hands out the batches before it first."""
        for groups in self._steps(texts, progress):
            yield [answer for done in groups for answer in done]

    @torch.inference_mode()
    def _steps(self, texts: list[str], progress=None) -> Iterator[list[list[tuple[int, Prediction]]]]:
        """steps(), each step's answers grouped by the batch they came from."""
        start = time.perf_counter()
        run = EngineStats(num_items=len(texts))
        item_ids, truncated = self.encode(texts)
        lengths = [len(ids) for ids in item_ids]
        waiting = _ScorerQueue(self._score_states)

        def hand_out() -> list[list[tuple[int, Prediction]]]:  # the waiting batches' decisions, one scorer call
            groups = []
            for batch, token_logprobs in waiting.drain():
                groups.append([(i, self._decide(texts[i], lps, self._prompt_len(lengths[i]), truncated[i], run))
                               for i, lps in zip(batch, token_logprobs, strict=True)])
                if progress:
                    progress(len(batch))
            return groups

        chunk = self._chunk_tokens
        for batch in self._plan(lengths, chunk):
            try:
                if chunk is not None and lengths[batch[0]] > chunk:
                    rows, done = yield from self._run_chunked(item_ids[batch[0]])
                else:
                    rows, done = self._run_batch([item_ids[i] for i in batch])
            except GeneratorExit:
                raise
            except BaseException:
                if finished := hand_out():  # the batches before this one still hand out their answers first
                    yield finished
                raise
            run.padding.add([lengths[i] for i in batch])
            run.num_batches += 1
            yield hand_out() if waiting.add(batch, rows, done) else []
        finished = hand_out()
        # the batches' activations leave the RSS once the call is done (not after each batch: the next batch would
        # fault every page back in)
        return_freed_memory()
        run.num_truncated = sum(truncated)
        run.seconds = time.perf_counter() - start
        self.last_stats = run
        self.stats.merge(run)
        yield finished

    @property
    def prefix(self):
        """The cached prompt prefix (its `length`), or None without the prefix cache."""
        return self.passes.prefix

    @property
    def _chunk_tokens(self) -> int | None:
        """config.chunk_tokens where chunked prefill applies: behind the prefix cache and without sliding windows
        (their rows go one at a time already: _batches). A head that reads every token of an item (a mean, a middle
        layer) gets them from the chunks put back together (_chunked_forward)."""
        if not self.prefix or self._window is not None:
            return None
        return self.config.chunk_tokens

    def _plan(self, lengths: list[int], chunk: int | None):
        """The batches (_batches) of the items that fit in one chunk (_chunk_tokens), then each longer item alone."""
        if chunk is None:
            yield from self._batches(lengths)
            return
        short = [i for i, n in enumerate(lengths) if n <= chunk]
        for batch in self._batches([lengths[i] for i in short]):
            yield [short[j] for j in batch]
        yield from ([i] for i, n in enumerate(lengths) if n > chunk)

    def _batches(self, lengths: list[int]):
        """plan_batches, except that with a sliding-window layer (Gemma 2 and 3) the rows of a batch whose columns
        would reach past the smallest window go one at a time. The window counts cache columns, not a row's own
        positions: behind right padding a label's continuation query sits at the batch's last column, where it would
        lose keys of a shorter row that the row alone still sees. Within the window every key is seen either way."""
        cfg = self.config
        batches = plan_batches(lengths, cfg.batch_size, cfg.max_batch_tokens, cfg.sort, cfg.max_padding,
                               cfg.batch_overhead_tokens)
        if self._window is None:
            yield from batches
            return
        room = self._window - (self.prefix.length if self.prefix else 0) - max(map(len, self.label_ids), default=1)
        for batch in batches:
            fits = [i for i in batch if lengths[i] <= room] if len(batch) > 1 else batch
            if fits:
                yield fits
            yield from ([i] for i in batch if i not in fits)

    def _decide(self, text: str, lps, num_tokens: int, truncated: bool, run: EngineStats | None = None) -> Prediction:
        """The setup's decision, or, for a near-tie (config.recheck_margin), the exact path's answer."""
        if self.config.recheck_margin is not None and self.setup.margin(lps) < self.config.recheck_margin:
            (run or self.stats).num_rechecked += 1
            return self.recheck(text)
        return self.setup.decide(lps, num_tokens, truncated)

    @torch.inference_mode()
    def features(self, texts: list[str], with_label_logprobs: bool = False, progress=None,
                 states: str = "last", layers: tuple[int, ...] = ()) -> torch.Tensor:
        """(N, F) float64 inputs of a head, in input order: each item's hidden states (head.item_states: the last
        one (H), the mean over its tokens (H), or both (2H)), the mean of each of `layers` (decoder layer outputs,
        H each), then, if asked, each task label's log-prob (L). The same batches and forward passes as classify."""
        item_ids, _ = self.encode(texts)
        lengths = [len(ids) for ids in item_ids]
        rows: list[torch.Tensor | None] = [None] * len(texts)
        for batch in self._batches(lengths):
            last, views, state = self._forward([item_ids[i] for i in batch], states, layers)  # (B, H), (B, F')
            label_lps = label_totals(self._token_logprobs(last, state)) if with_label_logprobs else None
            for i, row in zip(batch, head_features(views, label_lps), strict=True):  # (B, F)
                rows[i] = row
            if progress:
                progress(len(batch))
        return torch.stack(rows) if rows else torch.empty(0, 0, dtype=torch.float64)

    def _prompt_len(self, item_len: int) -> int:
        return item_len + (self.prefix.length if self.prefix else 0)

    def _run_batch(self, seqs: list[list[int]]):
        """One batch's forward pass(es): (rows, done). rows (N, H): the hidden states the label scorer must score
        (None when nothing is, as with a head that does not use label log-probs); done(log-probs of those rows)
        gives token_logprobs[row][label][k] (with a head, its log-probs: one step per head label). The scorer call
        is the caller's, so one call can serve several small batches (classify)."""
        return self._to_score(*self._forward(seqs, *self._head_reads))

    def _run_chunked(self, seq: list[int]):
        """_run_batch for one long item, chunk by chunk (_chunked_forward): a generator that yields [] after each
        chunk but the last and returns (rows, done)."""
        return self._to_score(*(yield from self._chunked_forward(seq, *self._head_reads)))

    @property
    def _head_reads(self) -> tuple[str, tuple[int, ...]]:
        """The item states (head.STATES) and decoder layers a forward pass must hand the head: the last state alone
        without a head."""
        return (self.head.states, self.head.layers) if self.head else ("last", ())

    def _to_score(self, last, states, state):
        head, batch = self.head, last.shape[0]
        if head is not None and not head.uses_label_logprobs:
            return None, lambda _: head.token_logprobs(states, None)
        rows = self._states_to_score(last, state)
        if head is not None:
            return rows, lambda lps: head.token_logprobs(states, self._by_label(lps, batch))
        return rows, lambda lps: self._by_label(lps, batch)

    def _chunked_forward(self, seq: list[int], states: str = "last", layers: tuple[int, ...] = ()):
        """_forward for one item, config.chunk_tokens of its tokens a pass behind the prefix cache, each pass's keys
        and values kept for the next (chunked prefill). A generator: yields [] after each pass but the last, returns
        _forward's (last, views, state). Each chunk starts a tile of the batch-invariant attention's queries where
        one pass over the item has one (chunks are whole tiles), so the same bits. A head that reads more than the
        last state gets each token's states from the chunks' outputs, put back into one (1, L, H) tensor per layer:
        the contiguous slice one pass gives its mean (head.item_states)."""
        size, every_token = self._chunk_tokens, _every_token(states, layers)
        finals: list[torch.Tensor] = []
        middles: list[list[torch.Tensor]] = [[] for _ in layers]
        state = None
        for start in range(0, len(seq), size):
            chunk = torch.tensor([seq[start:start + size]], device=self.device)  # (1, C)
            out = self.passes.chunk(state, chunk, start, len(seq), every_token, layers)
            state = out.state
            if every_token:
                finals.append(out.final)
                for parts, hidden in zip(middles, out.layers, strict=True):
                    parts.append(hidden)
            if start + size < len(seq):
                yield []
        views = out.last
        if every_token:
            views = item_states(torch.cat(finals, dim=1), [len(seq) - 1], [len(seq)], states,
                                tuple(torch.cat(parts, dim=1) for parts in middles))
        return out.last, views, state

    def _forward(self, seqs: list[list[int]], states: str = "last", layers: tuple[int, ...] = ()):
        """One pass over a right-padded batch behind the prefix: the final-norm hidden state at each item's
        last real token (B, H), the head's item states (head.item_states: that, the mean over the item's
        tokens, or both, then the means of `layers`) and the pass's state for the label scorer's continuations."""
        input_ids, item_mask, lengths = pad_right(seqs, self.pad_id)  # (B, L), (B, L), (B,)
        input_ids, item_mask, lengths = input_ids.to(self.device), item_mask.to(self.device), lengths.to(self.device)
        every_token = _every_token(states, layers)
        # without the prefix cache, the prefix is part of each sequence (the attention tiles its queries afresh
        # where the item starts, as a cached prefix's pass would: attention.segments)
        skip = 0 if self.prefix else len(self.prompt.prefix_ids)
        out = self.passes.batch(input_ids, item_mask, lengths, every_token, layers, skip)
        views = out.last
        if every_token:  # the item's own tokens: without the prefix, cached or part of the sequence
            ends = [len(seq) - 1 for seq in seqs]
            views = item_states(out.final, ends, [len(seq) - skip for seq in seqs], states, out.layers)
        return out.last, views, out.state

    def _token_logprobs(self, last, state) -> list[list[list[float]]]:
        """token_logprobs[row][label][k] from the batch's last hidden states (B, H) and its pass's state."""
        return self._by_label(self._score_states(self._states_to_score(last, state)), last.shape[0])

    def _score_states(self, rows: torch.Tensor) -> torch.Tensor:
        """The label tokens' log-probs (N, K) after each hidden state in rows (N, H), SCORER_ROWS at a time."""
        if rows.shape[0] <= SCORER_ROWS:
            return self.scorer.logprobs(rows)
        return torch.cat([self.scorer.logprobs(rows[i:i + SCORER_ROWS]) for i in range(0, rows.shape[0], SCORER_ROWS)])

    def _states_to_score(self, last, state) -> torch.Tensor:
        """The hidden states whose next-token log-probs score the labels: the items' last ones (B, H), then, for
        each context of a multi-token label (a proper prefix of its tokens; labels.trie_paths) in turn, those after
        feeding it behind each item (B, H) each (passes.continuation: each run on its own copy of the rows)."""
        states: dict[int, torch.Tensor] = {}
        for group in self._continuation_groups(last.shape[0], state.num_keys):
            runs = [self._runs[r] for r in group]
            states.update(zip(group, self.passes.continuation(state, runs, self.pad_id), strict=True))
        if not states:
            return last
        return torch.cat([last, *(states[run][:, k] for run, k in self._context_states)])

    def _continuation_groups(self, batch: int, keys: int) -> list[list[int]]:
        """The continuation runs (indices into _runs, shortest first) in groups that share a pass: as many as
        keep the pass's rows times keys within CONTINUATION_ROW_KEYS (at least one)."""
        groups: list[list[int]] = []
        for r, run in enumerate(self._runs):
            size = (len(groups[-1]) + 1) * batch * (keys + len(run)) if groups else None
            if size is None or size > CONTINUATION_ROW_KEYS:
                groups.append([r])
            else:
                groups[-1].append(r)
        return groups

    def _by_label(self, lps: torch.Tensor, batch: int) -> list[list[list[float]]]:
        """_states_to_score's log-probs (N, K) -> token_logprobs[row][label][k]."""
        col, context = self.scorer.column, self._context_index
        values = lps.tolist()
        return [[[values[row][col[ids[0]]]]
                 + [values[batch * (1 + context[ids[:k]]) + row][col[ids[k]]] for k in range(1, len(ids))]
                 for ids in self.label_ids]
                for row in range(batch)]


class _ScorerQueue:
    """Batches waiting for the label scorer: its vocabulary-wide GEMM reads the whole output head once per call, so one
    call serves the rows of several small batches (up to SCORER_ROWS), then each batch's `done` turns its rows'
    log-probs into its token_logprobs."""

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor]):
        self.score = score
        self.batches: list[tuple[list[int], torch.Tensor | None, Callable]] = []
        self.num_rows = 0

    def add(self, batch: list[int], rows: torch.Tensor | None, done: Callable) -> bool:
        """Queue a batch (rows None: nothing to score); True when the queue should be drained now."""
        self.batches.append((batch, rows, done))
        self.num_rows += 0 if rows is None else rows.shape[0]
        return self.num_rows >= SCORER_ROWS or rows is None

    def drain(self) -> Iterator[tuple[list[int], list]]:
        """(batch, token_logprobs) of every queued batch, in order, after one scorer call for all their rows."""
        batches, self.batches, self.num_rows = self.batches, [], 0
        rows = [r for _, r, _ in batches if r is not None]
        scores = self.score(torch.cat(rows)) if rows else None  # (N, K)
        start = 0
        for batch, batch_rows, done in batches:
            n = 0 if batch_rows is None else batch_rows.shape[0]
            yield batch, done(None if scores is None or not n else scores[start:start + n])
            start += n


def _every_token(states: str, layers: tuple[int, ...]) -> bool:
    """Whether a head reading these states and layers needs every token's hidden states, not the last one's alone."""
    return states != "last" or bool(layers)

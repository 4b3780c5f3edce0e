"""Prompt datasets from Parquet files in verl's column layout.

Columns (one row per prompt), as verl's preprocessing scripts write them:

- ``prompt`` (required): a list of chat messages ``{"role", "content"}``;
- ``reward_model`` (required): a struct with ``ground_truth`` (a string; numbers are
  accepted and turned into strings) and usually ``style``;
- ``data_source`` (optional, default: the file's stem): names the task;
- ``extra_info`` (optional, default ``{}``): anything else, passed to the reward;
- ``max_tokens`` (optional, fleetrl's own; null or absent: no budget of its own): this prompt's response
  budget, an integer >= 1. Its responses are cut at ``min(max_tokens, rollout.sampling.max_tokens)``
  (finish reason ``length``); with ``rollout.sampling.ignore_eos`` every response is exactly that long,
  the way a benchmark draws a long-tail length distribution (docs/long_context.md). The single-turn
  rollout worker applies it; multi-turn episodes and evaluation keep their own limits.

A GSM8K file preprocessed for verl loads unchanged. Every prompt must leave room for the
response under the engine's model length (``max_model_len - response_tokens``, and at most
``max_prompt_tokens``): one that does not is an error naming each file's longest prompt, or is
skipped and counted (``filter_overlong=True``, verl's ``filter_overlong_prompts``). Every row is
validated at load:
a bad row raises :class:`DatasetError` naming the file, the row and the column
(``on_bad_row="raise"``, the default), or is skipped and counted with one warning
(``on_bad_row="skip"``, for long runs over large files).

The reader yields prompts in shuffled epochs (a permutation per epoch drawn from
``(seed, epoch)``) and its read position is checkpointable: after
``load_state_dict(state_dict())`` it yields exactly the sequence it would have::

    ds = PromptDataset(["data/addition/train.parquet"], tokenizer, seed=0)
    first = ds.next_batch(16)
    state = ds.state_dict()   # save with the learner checkpoint
    ds.load_state_dict(state) # after a restart: the same next prompts
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and column."""


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One validated, tokenized prompt."""

    file: str
    row: int  # row number in ``file``
    messages: list[dict[str, str]]
    prompt_ids: np.ndarray  # int32, the chat template applied with the generation prompt
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the row's own response budget (column max_tokens); None: the config's

    @property
    def uid(self) -> str:
        """Stable id of the prompt across runs: file name and row."""
        return f"{Path(self.file).name}:{self.row}"


def truncate(ids: np.ndarray, limit: int, side: str) -> np.ndarray:
    """A prompt cut to ``limit`` tokens as verl cuts it: 'left' keeps the last tokens, 'right' the first,
    'middle' the first ``limit // 2`` and the last ``limit - limit // 2``."""
    if len(ids) <= limit:
        return ids
    if side == "left":
        return ids[len(ids) - limit :]
    if side == "right":
        return ids[:limit]
    if side == "middle":
        head = limit // 2
        return np.concatenate([ids[:head], ids[len(ids) - (limit - head) :]])
    raise ValueError(f"truncation side must be 'left', 'right' or 'middle', got {side!r}")


def _bad(file: str, row: int, column: str, problem: str) -> DatasetError:
    return DatasetError(f"{file} row {row}, column '{column}': {problem}")


def _check_messages(value: Any, file: str, row: int) -> list[dict[str, str]]:
    if value is None:
        raise _bad(file, row, "prompt", "missing (null)")
    if isinstance(value, np.ndarray):  # what a pandas round trip leaves behind
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise _bad(file, row, "prompt", f"expected a non-empty list of {{role, content}} messages, got {value!r:.80}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _bad(file, row, f"prompt[{j}]", f"expected {{'role': str, 'content': str}}, got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _check_ground_truth(value: Any, file: str, row: int) -> str:
    if value is None:
        raise _bad(file, row, "reward_model.ground_truth", "missing (null)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _bad(
            file, row, "reward_model.ground_truth", f"expected a string, got {type(value).__name__} {value!r:.80}"
        )
    return str(value)


# A budget is a token count: beyond int32 it is a typo or a unit mistake, not a length any engine serves.
MAX_ROW_BUDGET = 2**31 - 1


def check_row_budget(value: Any, file: str, row: int) -> int | None:
    """The ``max_tokens`` column of one row: None (no budget of its own) or an integer in 1..2**31-1.
    A float is taken when it is a whole number (pandas stores an integer column with nulls as float64)."""
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(file, row, "max_tokens", f"expected an integer >= 1, got {type(value).__name__} {value!r:.80}")
    if isinstance(value, float):
        if not value.is_integer():  # also NaN and infinities
            raise _bad(file, row, "max_tokens", f"expected a whole number of tokens, got {value!r}")
        value = int(value)
    if not 1 <= value <= MAX_ROW_BUDGET:
        raise _bad(file, row, "max_tokens", f"expected an integer in 1..{MAX_ROW_BUDGET}, got {value}")
    return value


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The raw rows of one verl-layout file, with the required columns checked."""
    import pyarrow.parquet as pq

    path = str(path)
    if not Path(path).exists():
        raise DatasetError(f"dataset file {path} does not exist")
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DatasetError(f"dataset file {path} is not readable Parquet: {exc}") from exc
    names = table.column_names
    for col in ("prompt", "reward_model"):
        if col not in names:
            raise DatasetError(f"{path}: column '{col}' is missing (every row needs it); columns present: {names}")
    rm_type = table.schema.field("reward_model").type
    if not hasattr(rm_type, "get_field_index") or rm_type.get_field_index("ground_truth") < 0:
        raise DatasetError(
            f"{path}: column 'reward_model.ground_truth' is missing; 'reward_model' has type {rm_type} "
            f"(expected a struct with a 'ground_truth' field)"
        )
    for col in ("images", "videos", "audios"):  # verl's multimodal layout (data.image_key and the like)
        if col in names and any(table.column(col).to_pylist()):
            raise DatasetError(
                f"{path}: column '{col}' holds media for a vision-language model; fleetrl trains on "
                "text prompts only (the media would be dropped silently)"
            )
    return table.to_pylist()


class PromptDataset:
    """Validated, tokenized prompts with seeded shuffled epochs and a resumable read position."""

    def __init__(
        self,
        files: list[str | Path],
        tokenizer: Any,
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_prompt_tokens: int = 1024,
        on_bad_row: Literal["raise", "skip"] = "raise",
        max_model_len: int | None = None,
        response_tokens: int = 0,
        filter_overlong: bool = False,
        truncation: Literal["error", "left", "right", "middle"] = "error",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if on_bad_row not in ("raise", "skip"):
            raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
        if not files:
            raise ValueError("PromptDataset needs at least one file")
        if truncation not in ("error", "left", "right", "middle"):
            raise ValueError(f"truncation must be 'error', 'left', 'right' or 'middle', got {truncation!r}")
        self.seed, self.shuffle = seed, shuffle
        self.truncation, self.template_kwargs = truncation, dict(chat_template_kwargs or {})
        self.truncated = 0  # prompts cut to the limit (truncation left/right/middle)
        # A prompt leaves room for the whole response: the engine would otherwise cut it short
        # silently (vLLM) or refuse the request.
        self.limit, self.limit_why = max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"
        if max_model_len is not None and max_model_len - response_tokens < self.limit:
            self.limit = max_model_len - response_tokens
            self.limit_why = f"rollout.max_model_len={max_model_len} - rollout.sampling.max_tokens={response_tokens}"
        if self.limit < 1:
            raise DatasetError(f"no prompt fits: {self.limit_why} leaves {self.limit} tokens for the prompt")
        self.skipped: list[str] = []  # the reason for each skipped row
        self.overlong: list[tuple[int, str, int]] = []  # (tokens, file, row) of each prompt over the limit
        self.rows: list[PromptRow] = []
        for f in files:
            for i, raw in enumerate(read_rows(f)):
                try:
                    row = self._row(str(f), i, raw, tokenizer)
                except DatasetError as err:
                    if on_bad_row == "raise":
                        raise
                    self.skipped.append(str(err))
                    continue
                if len(row.prompt_ids) > self.limit and not filter_overlong and truncation != "error":
                    row = replace(row, prompt_ids=truncate(row.prompt_ids, self.limit, truncation))
                    self.truncated += 1
                if len(row.prompt_ids) > self.limit:
                    self.overlong.append((len(row.prompt_ids), row.file, row.row))
                else:
                    self.rows.append(row)
        if self.overlong:
            self._report_overlong(files, response_tokens, filter_overlong)
        if self.truncated:
            logger.warning(
                "data.truncation=%s: cut %d prompts to %d tokens (%s)",
                truncation,
                self.truncated,
                self.limit,
                self.limit_why,
            )
        if self.skipped:
            logger.warning(
                "skipped %d bad rows of %d in %s; first: %s",
                len(self.skipped),
                len(self.rows) + len(self.skipped),
                [str(f) for f in files],
                self.skipped[0],
            )
        if not self.rows:
            raise DatasetError(f"no usable rows in {[str(f) for f in files]} ({len(self.skipped)} skipped)")
        # Identifies the data a saved read position belongs to.
        digest = hashlib.sha256()
        for r in self.rows:
            digest.update(f"{r.uid}\0{r.ground_truth}\0".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self._epoch, self._pos = 0, 0
        self._order = self._permutation(0)

    def _row(self, file: str, i: int, raw: dict[str, Any], tokenizer: Any) -> PromptRow:
        messages = _check_messages(raw.get("prompt"), file, i)
        rm = raw.get("reward_model")
        if not isinstance(rm, dict):
            raise _bad(file, i, "reward_model", f"expected a struct with 'ground_truth', got {rm!r:.80}")
        truth = _check_ground_truth(rm.get("ground_truth"), file, i)
        source = raw.get("data_source")
        if source is None:
            source = Path(file).stem
        elif not isinstance(source, str):
            raise _bad(file, i, "data_source", f"expected a string, got {type(source).__name__}")
        extra = raw.get("extra_info")
        if extra is None:
            extra = {}
        elif not isinstance(extra, dict):
            raise _bad(file, i, "extra_info", f"expected a struct/map, got {type(extra).__name__}")
        budget = check_row_budget(raw.get("max_tokens"), file, i)
        ids = self._tokenize(messages, tokenizer, file, i)
        return PromptRow(file, i, messages, ids, truth, source, extra, budget)

    def _tokenize(self, messages: list[dict[str, str]], tokenizer: Any, file: str, i: int) -> np.ndarray:
        # Render, then encode without special tokens: the template already holds what it
        # needs, and this path returns plain ids on both transformers 4 and 5.
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.template_kwargs
            )
        except Exception as exc:
            raise _bad(file, i, "prompt", f"chat template failed: {exc}") from exc
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise _bad(file, i, "prompt", "renders to zero tokens")
        return np.asarray(ids, dtype=np.int32)

    def _report_overlong(self, files: list, response_tokens: int, skip: bool) -> None:
        """Per file: how many prompts are over the limit and the longest one, named."""
        lines = []
        for f in dict.fromkeys(str(f) for f in files):
            mine = [o for o in self.overlong if o[1] == f]
            if mine:
                n, _, row = max(mine)
                lines.append(
                    f"{f}: {len(mine)} prompts over {self.limit} tokens, the longest row {row} "
                    f"with {n} tokens (chat template applied)"
                )
        longest = max(self.overlong)[0]
        if skip:
            logger.warning(
                "data.filter_overlong_prompts: skipped %d prompts over %d tokens (%s): %s",
                len(self.overlong),
                self.limit,
                self.limit_why,
                "; ".join(lines),
            )
            return
        raise DatasetError(
            f"prompts too long for {self.limit_why} = {self.limit} tokens:\n    "
            + "\n    ".join(lines)
            + f"\n  raise rollout.max_model_len to at least {longest + response_tokens} (or data.max_prompt_tokens), "
            "lower rollout.sampling.max_tokens, or set data.filter_overlong_prompts=true to skip them"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    @property
    def epoch(self) -> int:
        return self._epoch

    def next(self) -> PromptRow:
        """The next prompt; epochs roll over forever."""
        if self._pos >= len(self._order):
            self._epoch += 1
            self._pos = 0
            self._order = self._permutation(self._epoch)
        row = self.rows[self._order[self._pos]]
        self._pos += 1
        return row

    def next_batch(self, n: int) -> list[PromptRow]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._pos,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the read position; refuses a state saved over other data or another seed."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_rows", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"dataset state does not match this dataset: {key}={state.get(key)!r} in the state, "
                    f"{mine[key]!r} here (different files, filtering or seed)"
                )
        epoch, pos = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(pos, int) and 0 <= pos <= len(self.rows)):
            raise ValueError(f"bad dataset state: epoch={epoch!r}, position={pos!r} (rows: {len(self.rows)})")
        self._epoch, self._pos = epoch, pos
        self._order = self._permutation(epoch)


def load_tokenizer(model_path: str | Path) -> Any:
    """The model folder's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def from_config(
    cfg: Any,
    tokenizer: Any,
    *,
    seed: int,
    split: Literal["train", "test"] = "train",
    max_model_len: int | None = None,
    response_tokens: int = 0,
) -> PromptDataset:
    """A dataset from a :class:`rollout_fleet.config.DataConfig` (test split: no shuffle); prompts
    must leave ``response_tokens`` of room under ``max_model_len`` (the engine's)."""
    files = cfg.train_files if split == "train" else cfg.test_files
    return PromptDataset(
        files,
        tokenizer,
        seed=seed,
        shuffle=cfg.shuffle and split == "train",
        max_prompt_tokens=cfg.max_prompt_tokens,
        on_bad_row=cfg.on_bad_row,
        max_model_len=max_model_len,
        response_tokens=response_tokens,
        filter_overlong=cfg.filter_overlong_prompts,
        truncation=cfg.truncation,
        chat_template_kwargs=cfg.chat_template_kwargs,
    )

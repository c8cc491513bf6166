"""`streamspec batch IN.jsonl OUT.jsonl`: a resumable batch generation job.

IN holds one JSON object per line: an `id` (string or integer) and one of `prompt` (text: through the model's
chat template when it has one, unless `--raw` or the line's `"raw": true`), `messages` (a chat, always through
the template) or `prompt_ids`; optional `max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed` override the
command's flags for that line. Other keys are ignored, blank lines skipped.

OUT gets one JSON object per line, appended (flushed and fsynced) as soon as a prompt completes:
`{"id", "line", "text", "token_ids", "finish_reason", "stats"}`, or `{"id", "line", "error"}` for a line
that cannot run (not UTF-8, not JSON, no id, no prompt, a duplicate id, a bad option, too long for the context)
or whose generation failed (that line alone: the others run on); its error text starts with the line number of
IN ("line 7: ...").

Resume: rerunning the same command reads OUT first. A last line without its newline (a crash while writing
it) is cut off and that prompt redone. Ids with a result are skipped. Error records are not kept: OUT is
rewritten without them (atomically) and their lines are checked again, so a fixed IN fills them in and a
line still bad gets its error record again. So every id of IN has exactly one result in OUT at the end.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time

from .errors import ConfigError, StreamspecError

log = logging.getLogger("streamspec")


def _key(id_) -> str:
    return json.dumps(id_)  # 1 and "1" are different ids


class Output:
    """OUT, opened for appending under an exclusive lock (a second job on the same OUT is refused)."""

    def __init__(self, path: str):
        self.path = path
        self.repaired_bytes = 0
        self.dropped_errors = 0
        try:
            self.f = open(path, "a+b")
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror}") from None
        self._lock(self.f, path)
        self.done = self._load()

    @staticmethod
    def _lock(f, path: str) -> None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ConfigError(f"{path} is being written by another streamspec batch job") from None

    def _load(self) -> set[str]:
        """Repair a half-written last line, drop error records; -> the keys of ids that have a result."""
        self.f.seek(0)
        data = self.f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # killed mid-write: the bytes after the last newline are an unfinished record
            self.repaired_bytes = len(data) - end
            self.f.truncate(end)
            os.fsync(self.f.fileno())
            data = data[:end]
            log.warning("%s: removed a half-written last line (%d bytes); its prompt is redone", self.path,
                        self.repaired_bytes)
        done, kept = set(), []
        for n, line in enumerate(data.splitlines(keepends=True), 1):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or "id" not in rec:
                raise ConfigError(f"{self.path} line {n} is not a record of streamspec batch: fix or remove it")
            if "error" in rec:
                self.dropped_errors += 1
                continue
            done.add(_key(rec["id"]))
            kept.append(line)
        if self.dropped_errors:
            self._rewrite(b"".join(kept))
        return done

    def _rewrite(self, data: bytes) -> None:
        """Replace OUT by `data` atomically (a crash leaves the old or the new file, whole); the new file is
        locked before it takes OUT's name, so no other job can slip in."""
        tmp = f"{self.path}.tmp-{os.getpid()}"
        f = open(tmp, "w+b")
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        os.replace(tmp, self.path)
        _fsync_dir(self.path)
        self.f.close()
        self.f = f
        self.f.seek(0, os.SEEK_END)

    def write(self, rec: dict) -> None:
        # one write of the whole line: a kill leaves whole lines, at most the last one unfinished
        self.f.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_input(path: str, eng, defaults: dict, chat: bool | None, done: set[str]):
    """-> (requests to run, error records, ids skipped as done). Each request's tag is (id, line number)."""
    from .speculative.requests import to_request

    try:
        f = open(path, "rb")  # (bytes: a line that is not UTF-8 is that line's error, not the job's)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    requests, errors, skipped, seen = [], [], 0, {}
    with f:
        for n, data in enumerate(f, 1):
            if not data.strip():
                continue
            id_ = None
            try:
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})") from None
                try:
                    item = json.loads(text)
                except json.JSONDecodeError as e:  # (its "line 1 column 5" is inside the line: give the column)
                    raise ConfigError(f"not valid JSON: {e.msg} at column {e.colno}") from None
                if not isinstance(item, dict):
                    raise ConfigError("not a JSON object")
                id_ = item.get("id")
                if id_ is None:
                    raise ConfigError("no id")
                if isinstance(id_, bool) or not isinstance(id_, (str, int)):
                    raise ConfigError(f"id must be a string or an integer, got {json.dumps(id_)}")
                key = _key(id_)
                if key in seen:
                    raise ConfigError(f"duplicate id (first on line {seen[key]})")
                seen[key] = n
                if key in done:
                    skipped += 1
                    continue
                requests.append(to_request(eng, item, defaults, chat, tag=(id_, n)))
            except StreamspecError as e:
                errors.append({"id": id_, "line": n, "error": f"line {n}: {e}"})
    return requests, errors, skipped


def run(a) -> int:
    """The job behind `streamspec batch` (a: the parsed flags). Exit code 0 when every line has a result,
    1 when some lines got error records."""
    from tqdm.auto import tqdm

    from .speculative.requests import check_mode

    check_mode(a.mode)
    if a.replicas > 1 and not a.ray:
        raise ConfigError("--replicas needs --ray (in process there is one executor)")
    if os.path.abspath(a.input) == os.path.abspath(a.output):
        raise ConfigError("IN and OUT must be different files")
    check_paths(a.input, a.output)  # before any loading, and nothing is created on failure
    eng = _engine(a)
    try:
        out = Output(a.output)
        try:
            defaults = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed)
            requests, errors, skipped = read_input(a.input, eng, defaults,
                                                   True if a.chat else False if a.raw else None, out.done)
            for rec in errors:
                out.write(rec)
            return _generate(a, eng, out, requests, errors, skipped, tqdm)
        finally:
            out.close()
    finally:
        if hasattr(eng, "close"):
            eng.close()


def check_paths(inp: str, out: str) -> None:
    """IN must be a readable file and OUT writable (an existing file, or a new one in a writable folder)."""
    if not os.path.isfile(inp):
        raise ConfigError(f"cannot read {inp}: " + ("no such file" if not os.path.exists(inp) else "not a file"))
    if not os.access(inp, os.R_OK):
        raise ConfigError(f"cannot read {inp}: permission denied")
    if os.path.exists(out):
        if os.path.isdir(out) or not os.access(out, os.W_OK):
            raise ConfigError(f"cannot write {out}: {'a folder' if os.path.isdir(out) else 'permission denied'}")
    else:
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder):
            raise ConfigError(f"cannot write {out}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"cannot write {out}: folder {folder} is not writable")


def _engine(a):
    kw = dict(target=a.target, draft=a.draft if a.mode != "naive" else None, memory_budget=a.memory_budget,
              device=a.device, cold=a.cold, threads=a.threads or "auto")
    if a.ray:
        from .actors.engine import RayEngine
        return RayEngine(**kw, address=a.address, stages=getattr(a, "stages", None), split=getattr(a, "split", None))
    from .engine import Engine
    return Engine(**kw)


def _generate(a, eng, out: Output, requests, errors, skipped, tqdm) -> int:
    bar = tqdm(total=len(requests), unit="prompt", desc=f"batch {a.mode}", file=sys.stderr, disable=None,
               dynamic_ncols=True)
    tokens, t0, bad_lines = [0], time.perf_counter(), len(errors)

    def on_tokens(_i, new):
        tokens[0] += len(new)

    def on_result(i, res):
        id_, line = requests[i].tag
        if res.finish_reason == "error":  # this line alone failed: an error record, retried by a rerun
            errors.append({"id": id_, "line": line, "error": f"line {line}: generation failed: {res.error}"})
            out.write(errors[-1])
        else:
            stats = {k: v for k, v in res.stats.items() if k not in ("text", "token_ids", "finish_reason")}
            out.write({"id": id_, "line": line, "text": res.text, "token_ids": res.token_ids,
                       "finish_reason": res.finish_reason, "stats": stats})
        bar.set_postfix_str(f"{tokens[0] / (time.perf_counter() - t0):.1f} tok/s", refresh=False)
        bar.update(1)

    results = None
    try:
        if requests:
            results = eng.generate_batch(requests, batch_size=a.batch_size, mode=a.mode, k=a.k, budget=a.budget,
                                         replicas=a.replicas, on_result=on_result, on_tokens=on_tokens)
    finally:
        bar.close()
    s = results.stats if results is not None else None
    failed = len(errors) - bad_lines
    done = f"{len(requests) - failed} prompts done" + (f" ({skipped} already in {a.output})" if skipped else "")
    if s:
        log.info("%s: %d tokens in %.1f s (%.2f tok/s), %d sweeps (%.2f tokens/sweep, %.1f sequences/sweep), "
                 "%.1f MB read (%.2f MB/token)", done, s["new_tokens"], s["wall_s"], s["tokens_per_s"], s["sweeps"],
                 s["tokens_per_sweep"], s["sequences_per_sweep"], s["bytes_read"] / 1e6, s["bytes_per_token"] / 1e6)
    else:
        log.info("%s", done)
    if errors:
        log.info("%d lines could not run: error records in %s (a rerun checks them again)", len(errors), a.output)
    return 1 if errors else 0

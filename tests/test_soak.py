"""The soak's short check (benchmarks/soak.py): the real server with 8 slots under the mixed load
(completions, chat, streams, clients that disconnect mid-stream, over-context prompts, sampling
settings, bad JSON) for 3 minutes, on the tests' tiny model so that the time goes to requests,
not to compiling. Every request is answered with the status its kind expects, no 5xx, the
server stays up and logs no traceback. Memory growth is measured (the rows), not asserted: the
hour-long run on the default model is the benchmark."""
import json

import pytest

from benchmarks import soak
from helpers_models import save_hf_llama

pytestmark = pytest.mark.slow  # 3 minutes of load by design


def test_three_minutes_of_mixed_load(tmp_path):
    model = tmp_path / "tiny"
    save_hf_llama(model)
    out = tmp_path / "soak.jsonl"
    soak.main(["--minutes", "3", "--model", str(model), "--max-seq-len", "128",
               "--clients", "10", "--out", str(out), "--log-dir", str(tmp_path),
               "--server-args", "--no-warmup"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = rows[-1]
    assert list(summary) == ["kind", "minutes", "parallel", "requests", "rss_start_bytes",
                             "rss_end_bytes", "rss_growth", "server_errors", "p50_s", "p99_s",
                             "commit"]
    assert summary["minutes"] == 3 and summary["parallel"] == 8
    assert summary["server_errors"] == 0 and summary["requests"] > 100
    run = next(r for r in rows if r["kind"] == "run")
    assert run["unexpected"] == 0, run["unexpected_examples"]
    assert run["server_alive_at_end"] and run["tracebacks_in_log"] == 0
    # found by the first soak: clients gone mid-stream left asyncio tasks pending, logged as
    # "ERROR: Task was destroyed but it is pending!" (server/app.py _next)
    assert run["error_lines_in_log"] == [], run["error_lines_in_log"]
    assert all(run["by_kind"][k] > 0 for k in soak.KINDS)  # every kind of request was sent
    minutes = [r for r in rows if r["kind"] == "minute"]
    assert [m["minute"] for m in minutes] == [1, 2, 3] and all(m["tok_s"] > 0 for m in minutes)
    assert len([r for r in rows if r["kind"] == "sample"]) >= 18  # every 10 s

"""A bounded load test: 32 concurrent streaming clients (completions and chat, greedy and seeded
sampling, mixed prompt and output lengths) against one server with 8 slots. Every request must
complete with exactly the text it gets alone through the Python API: nothing lost, nothing mixed
between clients, whatever shared its decode steps."""
import asyncio
import random

import openai
import pytest

from helpers_models import CORPUS, save_hf_llama
from helpers_serve import MODEL, load, metric, serving

pytestmark = pytest.mark.slow  # a 32-client load test: minutes on 2 cores

CLIENTS = 32
SLOTS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_serve_load")
    save_hf_llama(d)
    return d


def workload(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    jobs = []
    for i in range(CLIENTS):
        start = rng.randrange(len(words))
        prompt = " ".join((words * 2)[start:start + rng.choice([1, 2, 4, 8, 12])])
        job = {"prompt": prompt, "max_tokens": rng.choice([1, 2, 5, 12, 24, 40]),
               "chat": i % 3 == 0}
        if i % 4 == 1:
            job.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        jobs.append(job)
    return jobs


async def run_client(client, job) -> str:
    kw = dict(model=MODEL, max_tokens=job["max_tokens"], stream=True,
              temperature=job.get("temperature", 0.0), top_p=job.get("top_p", 1.0))
    if "seed" in job:
        kw["seed"] = job["seed"]
    if job["chat"]:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": job["prompt"]}], **kw)
        return "".join([c.choices[0].delta.content or "" async for c in stream])
    stream = await client.completions.create(prompt=job["prompt"], **kw)
    return "".join([c.choices[0].text async for c in stream])


def test_32_concurrent_streams_each_get_their_own_output(tiny_dir):
    jobs = workload()
    ref = load(tiny_dir, max_batch=1)
    want = [ref.generate(j["prompt"], max_new_tokens=j["max_tokens"], chat=j["chat"],
                         temperature=j.get("temperature", 0.0), top_p=j.get("top_p", 1.0),
                         seed=j.get("seed", 0)).text for j in jobs]
    with serving(load(tiny_dir, max_batch=SLOTS).session, slots=SLOTS, queue_size=CLIENTS) as srv:
        async def main():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                        max_retries=0, timeout=300)
            return await asyncio.gather(*(run_client(client, j) for j in jobs),
                                        return_exceptions=True)

        got = asyncio.run(main())
        errors = [g for g in got if isinstance(g, BaseException)]
        assert not errors, errors[:3]
        mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not mismatched, [(jobs[i], got[i], want[i]) for i in mismatched[:3]]
        assert metric(srv.url, "pij_requests_total", endpoint="completions", status="200") + \
            metric(srv.url, "pij_requests_total", endpoint="chat", status="200") == CLIENTS
        # continuous batching happened: some decode steps advanced several sequences at once
        steps = metric(srv.url, "pij_decode_step_sequences_count")
        assert metric(srv.url, "pij_decode_step_sequences_bucket", le="2.0") < steps
        assert metric(srv.url, "pij_slots_busy") == 0 and metric(srv.url, "pij_queue_length") == 0

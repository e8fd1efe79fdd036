"""Engines stepped in different threads of one process (a server's engine thread beside an offline LLM, as the
server tests run them) must not see each other's step: each thread's result equals the same engine's run alone."""

import sys
import threading

from eightbit import LLM, SamplingParams

OPTIONS = dict(load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_gb=0.05)


def test_two_engines_in_two_threads_give_what_each_gives_alone():
    engines = {"a": LLM("llama-tiny", seed=1, **OPTIONS), "b": LLM("llama-tiny", seed=2, **OPTIONS)}
    prompts = {"a": [[(3 * i + j) % 500 + 5 for i in range(10 + j)] for j in range(4)],
               "b": [[(7 * i + j) % 500 + 5 for i in range(30 + 5 * j)] for j in range(4)]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate(name):
        return [o.outputs[0].token_ids for o in engines[name].generate(prompts[name], params, use_tqdm=False)]

    alone = {name: generate(name) for name in engines}
    together, errors = {name: [] for name in engines}, []

    def run(name):
        try:
            for _ in range(3):
                together[name].append(generate(name))
        except Exception as e:  # noqa: BLE001 - reported below, with the thread it came from
            errors.append(f"{name}: {type(e).__name__}: {e}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: inside every step
    try:
        threads = [threading.Thread(target=run, args=(name,)) for name in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert together == {name: [alone[name]] * 3 for name in engines}

"""Layer-by-layer conversion: peak memory stays far below the model's size.

The conversion runs in a subprocess that samples its anonymous resident memory (RssAnon:
heap and tensors, not the page cache of mmapped safetensors) every few milliseconds; glibc is
told to give large freed blocks back at once, so RssAnon tracks live tensors. Loading the
model whole would take at least its float32 size; the bound is half of that (the
fixed part: the meta model, tokenizer, calibration set and a 4 MB shard buffer, is ~20 MB).
"""

import json
import subprocess
import sys
import textwrap

from eightbit.quant.testing import make_tiny_checkpoint, make_tiny_tokenizer, tiny_text

CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch, transformers
    import transformers.models.llama.modeling_llama
    from eightbit.quant.cli import quantize
    from eightbit.calibrate.data import load_calibration_text

    load_calibration_text(sys.argv[3])  # imports datasets and fills its cache: not model memory
    transformers.AutoTokenizer.from_pretrained(sys.argv[1])

    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    src, out, calib = sys.argv[1:4]
    torch.set_num_threads(1)
    base, peak, done = rss_anon(), [0], [False]

    def watch():
        while not done[0]:
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.003)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    quantize(src, out, calib_data=calib, num_samples=2, seq_len=32, progress=False,
             max_shard_bytes=4 << 20, sample_tokens=64)
    done[0] = True
    t.join()
    print(json.dumps({"base": base, "peak": max(peak[0], rss_anon())}))
    print(json.dumps({"base": base, "peak": max(peak[0], rss_anon())}), file=sys.stderr)
    """
)


def test_peak_memory_is_a_fraction_of_the_model(tmp_path):
    src = make_tiny_checkpoint(
        tmp_path / "big", tokenizer=make_tiny_tokenizer(), max_shard_size="20MB", outliers=False,
        hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_hidden_layers=12,
    )
    model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert model_bytes > 140e6  # float32
    calib = tmp_path / "c.txt"
    calib.write_text(tiny_text(100))
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    import os

    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(tmp_path / "q"), str(calib)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["base"]
    assert (tmp_path / "q" / "config.json").is_file()
    assert grown < model_bytes / 2, f"peak grew by {grown / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model"

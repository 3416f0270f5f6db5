from common import *
from specdec.runtime.llamacpp import LlamaCppRuntime
from transformers import AutoTokenizer
import statistics
llm_tok = None
for exact in (True, False):
    rt = LlamaCppRuntime(GGUF, threads=1, context=8192, exact=exact)
    cache = rt.new_cache(1)
    from specdec.runtime.loading import load_model
    import specdec.api
    base = list(range(1000, 5000))
    t0 = time.perf_counter(); 
    for a in range(0, 4000, 256):
        rt.forward(cache, [0], [base[a:a+256]], last_only=True, prefill=True)
    pre = time.perf_counter() - t0
    ts = []
    for i in range(8):
        t0 = time.perf_counter(); rt.forward(cache, [0], [[100 + i]]); ts.append(time.perf_counter() - t0)
    print("exact" if exact else "f16", f"prefill 4000 in chunks of 256: {pre:.1f} s; decode step at 4000: {statistics.median(ts)*1000:.1f} ms", flush=True)
    del cache, rt

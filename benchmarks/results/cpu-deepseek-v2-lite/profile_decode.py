import cProfile, pstats, time
from pocketllm import LLM, SamplingParams
llm = LLM("/tmp/pocketllm-cpu-bench/deepseek-v2-lite-Q4_K_M.gguf", max_model_len=1024)
p = {"prompt_token_ids": list(range(100, 228))}
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
llm.generate([p], sp, use_tqdm=False)
t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); dt = time.perf_counter() - t
print("tok/s incl prefill", 48 / dt)
sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
t = time.perf_counter(); llm.generate([p], sp1, use_tqdm=False); pre = time.perf_counter() - t
print("decode ms/token", (dt - pre) / 47 * 1e3)
pr = cProfile.Profile(); pr.enable()
llm.generate([p], sp, use_tqdm=False)
pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(25)

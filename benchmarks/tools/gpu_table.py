"""The H200 table: reads the h200-*.json files of one `benchmarks/suites/gpu_run.sh` call and writes
h200.md with each figure, its goal, the peers measured on the same card, and its ratio to the
hardware ceiling (bandwidth for decode, bf16 matrix rate for prefill).

    python benchmarks/tools/gpu_table.py DIR   (DIR holds the JSON files; h200.md is written there)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BANDWIDTH = 4.3e12  # bytes/s, device copy measured on the lent H200
MATMUL = 790e12  # bf16 FLOP/s measured on the lent H200
# Llama-3.1-8B's shape: parameters, and KV bytes per token (32 layers x 8 heads x 128 x K,V x bf16)
PARAMS = 8.03e9
KV_PER_TOKEN = 32 * 8 * 128 * 2 * 2
KV_PER_TOKEN_OF = {"llama3-8b": KV_PER_TOKEN, "llama3-70b": 80 * 8 * 128 * 2 * 2,
                   "qwen3-30b-a3b": 48 * 4 * 128 * 2 * 2, "gpt-oss-20b": 24 * 8 * 64 * 2 * 2}
MOE_SHAPES = {"qwen3-30b-a3b", "gpt-oss-20b"}  # a step reads the active experts only: no whole-file ceiling
# The GGUF issue's goals, PocketLLM / llama.cpp on the same file: (shape-type, figure) -> ratio
GGUF_GOALS = {("llama3-8b-q4_k_m", "batch 1 decode"): 1.3, ("llama3-8b-iq2_xxs", "batch 1 decode"): 1.2,
              ("llama3-8b-q4_k_m", "64 seqs decode"): 2.0, ("llama3-8b-q4_k_m", "64 seqs prefill"): 2.0,
              ("llama3-8b-iq2_xxs", "64 seqs decode"): 1.5, ("llama3-70b-iq2_xxs", "batch 1 decode"): 1.2,
              # the MoE issue's
              ("qwen3-30b-a3b-q4_k_m", "batch 1 decode"): 1.2, ("qwen3-30b-a3b-q4_k_m", "64 seqs decode"): 2.0,
              ("gpt-oss-20b-mxfp4_moe", "batch 1 decode"): 1.0, ("gpt-oss-20b-mxfp4_moe", "64 seqs decode"): 2.0}
GPU_MEMORY_GOAL = 1.05  # GPU weight bytes / the file's tensor bytes
# Peers measured on the same card (the anchors, 2026-11-30; 512 prompt / 128 generated).
LLAMA_CPP = {"bf16_b1": 208.6, "bf16_64_decode": 5783, "bf16_64_prefill": 25717, "bf16_16_decode": 1932}
GPT_FAST = {"bf16_b1": 205.1, "bf16_16_decode": 2901, "bf16_64_decode": 8963, "bf16_64_prefill": 37567}


def load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def row_at(doc: dict | None, concurrency: int) -> dict | None:
    if doc is None:
        return None
    return next((r for r in doc["results"] if r.get("concurrency", r.get("batch")) == concurrency), None)


def gguf_table(d: Path) -> list[str]:
    """GGUF files: PocketLLM (h200-gguf-<shape>-<type>-*.json) beside llama.cpp on the same files in
    the same call (h200-llamacpp.json), with the issue's goals and the GPU weight memory."""
    peer, weights = load(d, "h200-llamacpp.json"), load(d, "h200-gguf-weight-memory.json")
    lats = sorted(d.glob("h200-gguf-*-latency.json"))
    if not lats:
        return []
    rows = []
    for lat_path in lats:
        tag = lat_path.name[len("h200-gguf-"):-len("-latency.json")]
        shape, qtype = tag.rsplit("-", 1)
        lat, tp = load(d, lat_path.name), load(d, f"h200-gguf-{tag}-throughput.json")
        theirs = (peer or {}).get("files", {}).get(f"{shape}-{qtype.upper()}.gguf", {})
        tensor = theirs.get("tensor_bytes")
        kv = KV_PER_TOKEN_OF.get(shape, KV_PER_TOKEN) * (512 + 64)
        counted = (weights or {}).get("files", {}).get(f"{shape}-{qtype.upper()}.gguf")
        if counted:  # the GPU-only count (the latency run's weight_bytes once counted host views too)
            memory = f"{counted['ratio']:.3f}"
        else:
            memory = f"{lat['weight_bytes'] / tensor:.3f}" if tensor and lat.get("weight_bytes") else ""
        b1, b64 = row_at(lat, 1), row_at(tp, 64)
        tensor_ceiling = None if shape in MOE_SHAPES else tensor
        figures = [("batch 1 decode", b1 and b1["decode_tok_s"], theirs.get("batch1", {}).get("decode_tok_s"),
                    BANDWIDTH / (tensor + kv) if tensor_ceiling else None),
                   ("64 seqs decode", b64 and b64["decode_tok_s"], theirs.get("batch64", {}).get("decode_tok_s"),
                    64 * BANDWIDTH / (tensor + 64 * kv) if tensor_ceiling else None),
                   ("64 seqs prefill", b64 and b64["prefill_tok_s"], theirs.get("batch64", {}).get("prefill_tok_s"),
                    None)]
        for name, ours, peer_value, ceiling in figures:
            if ours is None and peer_value is None:
                continue
            goal = GGUF_GOALS.get((tag, name), 1.0)
            ratio = ours / peer_value if ours and peer_value else None
            verdict = "" if ratio is None else "met" if ratio >= goal else "**missed**"
            rows.append(f"| {shape} {qtype.upper()} | {name} | {ours or 0:,.1f} | "
                        f"{f'{peer_value:,.1f}' if peer_value else 'not measured'} | "
                        f"{f'{ratio:.2f}x' if ratio else ''} | >= {goal}x {verdict} | "
                        f"{f'{ours / ceiling:.0%}' if ours and ceiling else ''} | {memory if name == 'batch 1 decode' else ''} |")
    first = load(d, lats[0].name)
    if peer is None:
        rows.append("| | llama.cpp not measured in this call (no h200-llamacpp.json) | | | | | | |")
    return [
        f"GGUF files (random weights, `pocketllm dummy-gguf`; commit `{first.get('commit')}"
        f"{'+wip' if first.get('dirty') else ''}`, {first.get('date')}): "
        "PocketLLM in bf16 and llama.cpp (CUDA, sm_90a, flash attention, all layers on the GPU) "
        "on the same files in the same device call; "
        "512-token prompts, 128 generated; batch 1 from `pocketllm bench latency` and `llama-bench` (pp512/tg128), "
        "64 sequences from `pocketllm bench throughput` and `llama-batched-bench`. Ceiling: the file's tensor bytes + "
        f"mean KV read per step at {BANDWIDTH / 1e12:.1f} TB/s. Memory: PocketLLM's GPU weight bytes / the file's "
        f"tensor bytes (goal <= {GPU_MEMORY_GOAL})"
        + (f"; for the files in h200-gguf-weight-memory.json (commit `{weights['commit']}`) from there, the others "
           "from the latency run's count, which also counted the host-side view of the embedding table"
           if weights else "") + ".",
        "",
        "| file | figure | PocketLLM tok/s | llama.cpp tok/s | ratio | goal | of ceiling | memory |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |",
        *rows,
        "",
    ]


def main() -> None:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    bf16_lat, bf16_tp = load(d, "h200-bf16-latency.json"), load(d, "h200-bf16-throughput.json")
    hf = load(d, "h200-transformers-baseline.json")
    ctx = 512 + 64  # mean context of a 512/128 decode
    rows = []

    def add(name, value, goal, peers, ceiling, unit="tok/s"):
        if value is None:
            rows.append(f"| {name} | not measured | {goal} | {peers} | | |")
            return
        ratio = f"{value / ceiling:.0%}" if ceiling else ""
        rows.append(f"| {name} | **{value:,.0f}** {unit} | {goal} | {peers} | {ceiling:,.0f} | {ratio} |")

    b1 = row_at(bf16_lat, 1)
    add("bf16 decode, batch 1", b1 and b1["decode_tok_s"], ">= 240",
        f"llama.cpp {LLAMA_CPP['bf16_b1']}, gpt-fast-style {GPT_FAST['bf16_b1']}"
        + (f", transformers {row_at(hf, 1)['output_tok_s']:.1f}" if row_at(hf, 1) else ""),
        BANDWIDTH / (2 * PARAMS + ctx * KV_PER_TOKEN))
    r16 = row_at(bf16_tp, 16)
    add("bf16 decode, 16 sequences", r16 and r16["decode_tok_s"], "",
        f"llama.cpp {LLAMA_CPP['bf16_16_decode']}, gpt-fast-style {GPT_FAST['bf16_16_decode']}",
        16 * BANDWIDTH / (2 * PARAMS + 16 * ctx * KV_PER_TOKEN))
    r64 = row_at(bf16_tp, 64)
    add("bf16 decode, 64 sequences", r64 and r64["decode_tok_s"], ">= 10,000",
        f"llama.cpp {LLAMA_CPP['bf16_64_decode']}, gpt-fast-style {GPT_FAST['bf16_64_decode']}"
        + (f", transformers {row_at(hf, 64)['output_tok_s']:.0f}" if row_at(hf, 64) else ""),
        64 * BANDWIDTH / (2 * PARAMS + 64 * ctx * KV_PER_TOKEN))
    add("bf16 prefill, 64 x 512 tokens", r64 and r64["prefill_tok_s"], ">= 40,000",
        f"llama.cpp {LLAMA_CPP['bf16_64_prefill']}, gpt-fast-style {GPT_FAST['bf16_64_prefill']}",
        MATMUL / (2 * PARAMS))
    serve = load(d, "h200-bf16-serve-64.json")
    lines = []
    s18, o18 = load(d, "h200-bf16-serve-1-8.json"), load(d, "h200-bf16-offline-for-serve.json")
    offline = row_at(o18, 64) or r64  # offline at 64 in the serve stage's run, when it has one
    if serve:
        lines.append(f"Serving (commit `{serve.get('commit')}`, {serve.get('date')}; the server and the offline "
                     "engine in one run):")
        lines.append("")
    if serve and offline and not any(r.get("errors") for r in serve["results"]):
        s64 = serve["results"][0]["output_tok_s"]
        lines.append(f"- HTTP at 64 concurrent clients: {s64:,.0f} output tok/s vs offline {offline['output_tok_s']:,.0f} "
                     f"({s64 / offline['output_tok_s']:.2f}x; goal >= 0.85x)")
    failed = [r.get("first_error") for doc in (serve, s18) if doc for r in doc["results"] if r.get("errors")]
    if failed:
        lines.append(f"- Through HTTP: not measured (the benchmark's requests failed: {failed[0]!r})")
    elif s18 and o18:
        srv = {r["concurrency"]: r for r in s18["results"]}
        off = {r["concurrency"]: r for r in o18["results"]}
        base = srv[1]["output_tok_s"]
        lines.append("- Through the server, output tok/s at 1/2/4/8 streams: "
                     + " / ".join(f"{srv[c]['output_tok_s']:,.0f}" for c in (1, 2, 4, 8))
                     + "; scaling vs one stream " + " / ".join(f"{srv[c]['output_tok_s'] / base:.2f}x" for c in (2, 4, 8))
                     + " (goals 1.7x / 3.0x / 4.5x)")
        lat = srv[1]["e2e_p50_ms"] / (1e3 * off[1]["e2e_p50_s"]) if srv[1].get("e2e_p50_ms") else None
        if lat:
            lines.append(f"- Single-request latency through HTTP / offline: {lat:.3f}x (goal <= 1.05x)")
        lines.append("- Queue time p99 at 1/2/4/8 streams (ms): "
                     + " / ".join(f"{srv[c]['queue_p99_ms']:.1f}" if srv[c].get("queue_p99_ms") is not None else "n/a"
                                  for c in (1, 2, 4, 8)) + " (goal <= 50 ms)")
    # Synchronous vs asynchronous scheduling, measured together: the h200-bf16-sync-*.json files
    # of one run, with that run's asynchronous figures (h200-bf16-async-*.json, else the main ones).
    sched = []
    sync_lat, sync_tp = load(d, "h200-bf16-sync-latency.json"), load(d, "h200-bf16-sync-throughput.json")
    async_lat = load(d, "h200-bf16-async-latency.json") or bf16_lat
    async_tp = load(d, "h200-bf16-async-throughput.json") or bf16_tp
    if sync_lat and sync_tp and row_at(async_lat, 1) and row_at(async_tp, 64):
        s1, s64 = row_at(sync_lat, 1)["decode_tok_s"], row_at(sync_tp, 64)["decode_tok_s"]
        sched.append(f"- Scheduling, bf16 decode (commit `{sync_lat.get('commit')}`, one run): synchronous "
                     f"(`--no-async-scheduling`) batch 1 {s1:,.0f} tok/s, 64 sequences {s64:,.0f} tok/s; "
                     f"asynchronous (the default on CUDA) {row_at(async_lat, 1)['decode_tok_s']:,.0f} and "
                     f"{row_at(async_tp, 64)['decode_tok_s']:,.0f}")
    gguf_lines = gguf_table(d)
    meta = bf16_lat or bf16_tp or {}
    out = [
        "# H200 results (Llama-3.1-8B shape, random weights, 512 prompt / 128 generated tokens)",
        "",
        f"Commit `{meta.get('commit')}`, {meta.get('date')}, {meta.get('machine', {}).get('gpu')}, "
        f"torch {meta.get('machine', {}).get('torch')}. Ceilings: {BANDWIDTH / 1e12:.1f} TB/s copy bandwidth "
        f"(weights + mean KV read per step) for decode, {MATMUL / 1e12:.0f} TFLOP/s bf16 for prefill "
        "(2 x params FLOP per token, attention not counted). Peers: llama.cpp (CUDA, flash attention) and a "
        "gpt-fast-style static-cache decoder from the issue's anchors on the same card; transformers "
        f"(eager `generate`) from h200-transformers-baseline.json (commit `{(hf or {}).get('commit')}`).",
        "",
        "| figure | PocketLLM | goal | peers | ceiling | of ceiling |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
        *rows,
        "",
        *gguf_lines,
        *sched,
        "",
        *lines,
        "",
    ]
    (d / "h200.md").write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()

"""Models by name from a Hugging Face hub (a local server speaking its file API, tests/fake_hub.py): a
safetensors repo and a GGUF repo with quant tags and a split file load by name and generate what the
same files give from disk; a cut transfer resumes, a corrupted file is fetched again, offline mode
reads the cache (and fails clearly without it), and `pocketllm pull / list / rm` manage the cache."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import prompts_of
from fake_hub import FakeHub
from live_server import in_process

from pocketllm import LLM, SamplingParams
from pocketllm import hub as pocket_hub
from pocketllm.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]
SAFETENSORS, GGUF_REPO = "test/tiny-llama", "test/tiny-llama-GGUF"


def split_gguf(src: Path, out_dir: Path, stem: str, parts: int = 2) -> list[Path]:
    """`src` (a file of float tensors) as llama.cpp's gguf-split writes it: STEM-0000k-of-0000N.gguf, the
    metadata in the first part, the tensors spread over all (gguf's writer adds the split.* keys)."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out_dir / f"{stem}.gguf", reader.fields["general.architecture"].contents(),
                        split_max_tensors=-(-len(reader.tensors) // parts))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out_dir.glob(f"{stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def hub(tiny_models, tmp_path_factory):
    from pocketllm.loaders.gguf_writer import write_gguf

    made = tmp_path_factory.mktemp("repos")
    _, local = tiny_models["llama"]
    fake = FakeHub()
    fake.add(SAFETENSORS, {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()})
    files = {}
    for qtype in ("Q8_0", "Q4_0", "F32"):
        files[f"tiny-llama-{qtype}.gguf"] = write_gguf(local, made / f"tiny-llama-{qtype}.gguf", qtype).path.read_bytes()
    (made / "split").mkdir()
    for part in split_gguf(made / "tiny-llama-F32.gguf", made / "split", "tiny-llama-F32"):
        files[f"F32/{part.name}"] = part.read_bytes()
    del files["tiny-llama-F32.gguf"]  # the F32 model only as its split parts
    fake.add(GGUF_REPO, files)
    with in_process(fake.app()) as url:
        fake.url, fake.local, fake.made = url, local, made
        yield fake


@pytest.fixture
def cache(hub, tmp_path, monkeypatch):
    """An empty huggingface_hub cache, the hub at the fake's address (what HF_ENDPOINT and HF_HUB_CACHE set)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.log.clear()
    return tmp_path / "hub"


def greedy(model: str | Path, **kw) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(model), device="cpu", dtype="float32", exact_kernels=True, max_model_len=64, num_kv_blocks=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_of([5, 9])],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def gets(hub: FakeHub, file: str) -> list[str | None]:
    """The Range header of each GET of `file`."""
    return [rng for method, path, rng in hub.log if method == "GET" and path.endswith("/" + file)]


def test_a_safetensors_repo_by_name_is_its_local_files(hub, cache):
    llm, tokens = greedy(SAFETENSORS)
    assert llm.engine.model_name == SAFETENSORS and Path(llm.engine.args.model).is_relative_to(cache)
    assert tokens == greedy(hub.local)[1]
    hub.log.clear()
    greedy(SAFETENSORS)  # the second time from the cache: the hub is asked what is current, nothing fetched
    assert not gets(hub, "model.safetensors")


def test_a_gguf_repo_by_quant_tag_and_a_split_file(hub, cache):
    assert pocket_hub.resolve(f"{GGUF_REPO}:q8_0").name == "tiny-llama-Q8_0.gguf"  # tags in any case
    assert pocket_hub.resolve(GGUF_REPO).name == "tiny-llama-Q4_0.gguf"  # no tag: the first of DEFAULT_QUANTS there
    with pytest.raises(ConfigurationError, match="has no Q6_K file; it has: tiny-llama-F32.gguf, tiny-llama-Q4_0.gguf"):
        pocket_hub.resolve(f"{GGUF_REPO}:Q6_K")
    llm, tokens = greedy(f"{GGUF_REPO}:F32")  # both parts fetched, opened as one model
    assert Path(llm.engine.args.model).name == "tiny-llama-F32-00001-of-00002.gguf"
    assert gets(hub, "tiny-llama-F32-00002-of-00002.gguf")
    assert tokens == greedy(hub.made / "tiny-llama-F32.gguf")[1] == greedy(hub.local)[1]
    with pytest.raises(ConfigurationError, match="no model 'test/missing' on the hub"):
        pocket_hub.resolve("test/missing")
    # a model larger than the device holds is refused from the listing, before a byte of it is fetched
    hub.log.clear()
    with pytest.raises(ConfigurationError, match=r"takes 0.0 GiB, more than the 0.0 GiB this device has"):
        pocket_hub.resolve(f"{GGUF_REPO}:Q8_0", max_bytes=1000)
    assert not gets(hub, "tiny-llama-Q8_0.gguf")


def test_a_cut_transfer_resumes_and_a_corrupted_file_is_fetched_again(hub, cache, caplog, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)  # (10 MB: written to disk only every 10 MB)
    name = "tiny-llama-Q8_0.gguf"
    hub.cut.add(name)
    path = pocket_hub.resolve(f"{GGUF_REPO}:Q8_0")
    ranges = gets(hub, name)
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert path.read_bytes() == hub.repos[GGUF_REPO][name]
    hub.corrupt.add("model.safetensors")
    folder = pocket_hub.resolve(SAFETENSORS)
    assert len(gets(hub, "model.safetensors")) == 2 and "does not have the hub's sha256" in caplog.text
    assert (folder / "model.safetensors").read_bytes() == hub.repos[SAFETENSORS]["model.safetensors"]


def test_offline_mode_reads_the_cache_and_fails_clearly_without_it(hub, cache, monkeypatch):
    from huggingface_hub import constants

    online = pocket_hub.resolve(f"{GGUF_REPO}:Q8_0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.log.clear()
    assert pocket_hub.resolve(f"{GGUF_REPO}:Q8_0") == online and not hub.log
    with pytest.raises(ConfigurationError, match="is not in the cache, and HF_HUB_OFFLINE=1 forbids fetching it"):
        pocket_hub.resolve(SAFETENSORS)


def test_pull_list_and_rm_on_the_command_line(hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0"}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pocketllm.cli.main", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    path = Path(cli("pull", f"{GGUF_REPO}:Q4_0").strip())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(
        hub.repos[GGUF_REPO]["tiny-llama-Q4_0.gguf"]).hexdigest()
    listed = cli("list")
    assert GGUF_REPO in listed and "tiny-llama-Q4_0.gguf" in listed
    assert f"removed {GGUF_REPO}" in cli("rm", GGUF_REPO)
    assert GGUF_REPO not in cli("list")


def test_a_draft_model_named_on_the_hub(hub, cache):
    """speculative_config's draft model by name: fetched as the model is, the greedy tokens unchanged."""
    draft = {"method": "draft_model", "model": SAFETENSORS, "num_speculative_tokens": 2}
    llm, tokens = greedy(hub.local, speculative_config=draft)
    assert gets(hub, "model.safetensors") and tokens == greedy(hub.local)[1]
    assert llm.engine.speculator.stats.acceptance_rate > 0.9  # the model itself drafts

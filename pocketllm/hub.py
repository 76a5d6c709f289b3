"""Models by name: a Hugging Face repo id, `org/name`, with an optional `@revision` and, for a repo of
GGUF files, a quant tag (`org/name-GGUF:Q4_K_M`, llama.cpp's `-hf` syntax). Files come through
`huggingface_hub` into its shared cache (resumable; `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` as
the other tools read them), and each large file is checked against the hub's sha256. A safetensors repo
gives its snapshot folder (config, tokenizer, weights); a GGUF repo the chosen file, every part of a
split file fetched (the loader opens the others beside the first)."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pocketllm.core.hub_name import HubName
from pocketllm.errors import ConfigurationError, DoesNotFitError
from pocketllm.gguf_file import split_name
from pocketllm.pull import sha256_of

log = logging.getLogger("pocketllm")

# a GGUF repo's file when no tag is given: llama.cpp's -hf default, then the next best-kept mixes
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q8_0")
# what a safetensors repo's snapshot needs: the model's config and weights, its tokenizer and templates,
# sentence-transformers' pooling files
_SAFETENSORS_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "1_Pooling/*")


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int
    sha256: str | None  # a large (LFS) file's hash as the hub records it


def resolve(name: HubName | str, *, max_bytes: int | None = None) -> Path:
    """The local path of a named model, fetched first where the cache does not hold it. `max_bytes`: refuse
    (before fetching anything large) a model whose files are larger."""
    hub = name if isinstance(name, HubName) else HubName.parse(name)
    if hub is None:
        raise ConfigurationError(f"{name!r} is not a model name (org/name[@revision][:QUANT])")
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _from_cache(hub)
    files = _listing(hub)
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    chosen = choose_gguf(ggufs, hub.quant, hub.repo) if ggufs else [
        f for f in files if any(Path(f.name).match(p) for p in _SAFETENSORS_FILES)]
    names = {f.name for f in chosen}
    if not ggufs and not ("config.json" in names and any(n.endswith(".safetensors") for n in names)):
        raise ConfigurationError(f"{hub.repo} holds neither GGUF files nor a config.json with safetensors weights")
    total = sum(f.size for f in chosen)
    if max_bytes is not None and total > max_bytes:
        raise DoesNotFitError(f"{hub} takes {total / 2**30:.1f} GiB, more than the {max_bytes / 2**30:.1f} GiB "
                                 "this device has for it; choose a smaller quant tag or model")
    log.info("fetching %s (%d files, %.1f MiB) from %s", hub, len(chosen), total / 2**20, _hub())
    paths = {f.name: _fetch(hub, f) for f in chosen}
    return paths[chosen[0].name] if ggufs else paths["config.json"].parent  # (the snapshot's folder)


def choose_gguf(files: list[RepoFile], quant: str | None, repo: str = "") -> list[RepoFile]:
    """The file a tag names (all parts of a split one), or without a tag the first of DEFAULT_QUANTS the
    repo has, else its smallest model (projector files of vision models left out)."""
    models: dict[str, list[RepoFile]] = {}
    for f in files:
        if "mmproj" in f.name.lower():
            continue
        split = split_name(f.name)
        models.setdefault(f"{split[0]}.gguf" if split else f.name, []).append(f)
    if not models:
        raise ConfigurationError(f"{repo} has no GGUF model file")

    def tagged(tag: str) -> list[str]:
        pattern = re.compile(rf"(^|[-_./]){re.escape(tag)}([-_.]|$)", re.IGNORECASE)
        return [m for m in models if pattern.search(Path(m).name)]

    if quant is not None:
        found = tagged(quant)
        if not found:
            raise ConfigurationError(f"{repo} has no {quant} file; it has: "
                                     + ", ".join(sorted(Path(m).name for m in models)))
    else:
        found = next((m for tag in DEFAULT_QUANTS if (m := tagged(tag))), None) or [
            min(models, key=lambda m: sum(f.size for f in models[m]))]
    return sorted(models[min(found, key=len)], key=lambda f: f.name)


def _listing(hub: HubName) -> list[RepoFile]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi(endpoint=_hub()).model_info(hub.repo, revision=hub.revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise ConfigurationError(f"no model {hub.repo!r} on the hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigurationError(f"{hub.repo} has no revision {hub.revision!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ConfigurationError(f"could not reach the hub for {hub}: {e} (HF_HUB_OFFLINE=1 uses the cache)") from None
    return [RepoFile(s.rfilename, int(s.size or 0), getattr(s.lfs, "sha256", None) if s.lfs else None)
            for s in info.siblings or []]


def _fetch(hub: HubName, f: RepoFile) -> Path:
    """One file through huggingface_hub's cache (under the revision's name, so that offline use finds it), its
    sha256 checked where the hub records one: a file that does not match is fetched once more, then refused."""
    from huggingface_hub import hf_hub_download

    for attempt in range(2):
        path = Path(hf_hub_download(hub.repo, f.name, revision=hub.revision, force_download=attempt > 0,
                                    endpoint=_hub(), cache_dir=_cache()))
        if f.sha256 is None or sha256_of(path) == f.sha256:
            return path
        log.warning("%s/%s does not have the hub's sha256: fetching it again", hub.repo, f.name)
    raise ConfigurationError(f"{hub.repo}/{f.name} does not have the sha256 the hub records ({f.sha256}); refusing it")


def _hub() -> str:
    """The hub's address: HF_ENDPOINT as it is now (huggingface_hub reads it once, at import), passed on."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _from_cache(hub: HubName) -> Path:
    """Offline: the cached snapshot's model, chosen from its files as when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        root = Path(snapshot_download(hub.repo, revision=hub.revision, local_files_only=True, cache_dir=_cache()))
    except (LocalEntryNotFoundError, OSError):
        raise ConfigurationError(f"{hub} is not in the cache, and HF_HUB_OFFLINE=1 forbids fetching it") from None
    ggufs = [RepoFile(str(p.relative_to(root)), p.stat().st_size, None) for p in root.rglob("*.gguf")]
    if ggufs:
        return root / choose_gguf(ggufs, hub.quant, hub.repo)[0].name
    if not (root / "config.json").is_file():
        raise ConfigurationError(f"the cached {hub} has no model files")
    return root


def cached_models() -> list[tuple[str, int, str]]:
    """(name, bytes, files) of each model repo in huggingface_hub's cache, and of the default model's cache."""
    from huggingface_hub import scan_cache_dir

    from pocketllm.pull import cache_dir

    rows = []
    try:
        repos = scan_cache_dir(_cache()).repos
    except Exception:  # noqa: BLE001  (no cache yet, or an unreadable one: nothing to list)
        repos = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        files = sorted({f.file_name for rev in repo.revisions for f in rev.files
                        if f.file_name.endswith((".gguf", ".safetensors"))})
        rows.append((repo.repo_id, repo.size_on_disk, ", ".join(files) or "(no weights)"))
    for path in sorted(cache_dir().glob("*.gguf")) if cache_dir().is_dir() else []:
        rows.append((f"default ({path.name})", path.stat().st_size, str(path)))
    return rows


def remove(name: HubName) -> str:
    """Delete a repo's cached revisions (all, or the one named); what was freed, in words."""
    from huggingface_hub import scan_cache_dir

    cache = scan_cache_dir(_cache())
    repo = next((r for r in cache.repos if r.repo_id == name.repo and r.repo_type == "model"), None)
    revisions = [] if repo is None else [r.commit_hash for r in repo.revisions
                                         if name.revision is None or name.revision in (r.commit_hash, *r.refs)]
    if not revisions:
        raise ConfigurationError(f"{name} is not in the cache")
    strategy = cache.delete_revisions(*revisions)
    strategy.execute()
    return f"{name.repo} ({strategy.expected_freed_size / 2**20:.1f} MiB)"

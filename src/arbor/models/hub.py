"""Models and tokenizers named by Hugging Face hub id (`model.name = "Qwen/Qwen3-4B"`), resolved to a local
snapshot directory that the rest of arbor reads as it reads any checkpoint directory.

Resolution of a name, in order: an existing local directory is used as it is; an `org/name` id is looked up
in the standard Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`; what `hf download` fills) and, when it is not
there and the hub may be reached (`HF_HUB_OFFLINE` unset), downloaded into that cache with `snapshot_download`
(only the files arbor reads: config, tokenizer, safetensors). When neither works the error is one line naming
the key, the id and the way out (download it once online, or give a directory). Preflight resolves the model
before any process starts, so the processes themselves find the snapshot in the cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""`org/name` as the hub spells repository ids."""
FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What arbor reads of a checkpoint: config and index, weights, tokenizer files and chat templates."""


class HubError(FileNotFoundError):
    """A hub id that neither the cache nor the hub can provide; the message is one line."""


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub id rather than a local path (an existing directory always wins)."""
    return bool(HUB_ID.match(name)) and not Path(name).exists()


def hub_offline() -> bool:
    """Whether the hub must not be contacted (`HF_HUB_OFFLINE=1`, read when called so tests can set it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_dir(name: str, key: str = "model.name") -> Path:
    """The local directory holding `name` (a directory, or a hub id's snapshot: cached, else downloaded)."""
    if not is_hub_id(name):
        return Path(name)
    # huggingface_hub takes most of a second to import: only hub ids pay for it, never presets or directories.
    from huggingface_hub import constants, snapshot_download  # see above
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError  # see above

    try:  # the cache first: no network round trip for a model already there
        return Path(snapshot_download(name, allow_patterns=FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    cache = constants.HF_HUB_CACHE
    if hub_offline() or constants.HF_HUB_OFFLINE:
        raise HubError(
            f"{key} {name!r} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
            f"download it once online (`hf download {name}`) or give a local directory{_as_path(name)}"
        ) from None
    try:
        return Path(snapshot_download(name, allow_patterns=FILES))
    except RepositoryNotFoundError:
        raise HubError(
            f"{key} {name!r} is neither a local directory nor a Hugging Face model id the hub knows "
            f"(private models need `hf auth login`){_as_path(name)}"
        ) from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:  # no network, or the hub failed
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubError(
            f"{key} {name!r} is not in the Hugging Face cache ({cache}) and could not be downloaded "
            f"({reason}): download it where the hub is reachable, or give a local directory{_as_path(name)}"
        ) from None


def _as_path(name: str) -> str:
    """A hint for a hub-id-shaped name whose first part is a local directory (`outputs/tiny-vl` before the
    script that writes it ran): most likely a path that does not exist yet, which the hub's error alone hides."""
    parent = Path(name).parent
    if not parent.is_dir():
        return ""
    return f"; read as a local path, {name!r} does not exist (its parent {str(parent) + '/'!r} does)"


def cached_config(name: str) -> Path | None:
    """`config.json` of `name` (a directory, or a hub id's snapshot already in the cache) without any network
    access or download; None when it is not on this machine (the config check then leaves the shape to the
    process that loads the model)."""
    if not is_hub_id(name):
        path = Path(name) / "config.json"
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache  # as in resolve_dir: only hub ids pay for the import

    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None

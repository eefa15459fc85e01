"""A checkpoint's manifest: every file's size and CRC-32, written last before the publish.

A network filesystem that loses the tail of a file, a disk that flips a bit, a copy that
stopped half-way: without a record of what was written, such a checkpoint is found out only
by a deserialisation traceback at resume (or not at all, for a flipped byte in a tensor). So
``save_training_checkpoint`` writes ``manifest.json`` into the temporary folder after every
other file, and ``check_resumable`` compares the checkpoint with it before anything is loaded.

* **Sizes** of every listed file are compared on every rank (a ``stat`` each).
* **Checksums** (CRC-32 over 8 MiB chunks, ``zlib``: about 3 GB/s from the page cache, three
  to six times blake2b's speed; docs/reliability.md has the measurement) are computed, at
  publish and at resume alike, by every rank over its share of the files (shares balanced by
  size), so each byte is read once and the ranks read in parallel. CRC-32 finds accidental
  damage (truncation, a changed byte, a mixed-up file); it is no defence against a crafted
  file (checkpoints hold pickles: resume only checkpoints you trust).
* Files added after the publish (the ``universal/`` form a resume on another number of
  processes converts into the checkpoint) are not listed and not checked.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from ..runtime.distributed import all_gather_object, get_rank, get_world_size, is_main_process
from .folders import naming

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
CHUNK_BYTES = 8 << 20


def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes as 8 hex digits, read in ``CHUNK_BYTES`` chunks.

    Example:
        >>> file_crc32("checkpoint-8/scheduler.bin")
        '1c291ca3'
    """
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def balanced_shares(items: dict, world: int) -> list[list]:
    """Split ``{item: cost}`` into ``world`` lists of about equal cost: largest first, each to
    the least loaded rank (ties: the lower rank). The same on every rank (sorted input)."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for item, cost in sorted(items.items(), key=lambda kv: (-kv[1], kv[0])):
        r = loads.index(min(loads))
        shares[r].append(item)
        loads[r] += cost
    return shares


def _listing(folder: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``folder`` but the manifest."""
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if rel != MANIFEST_FILE:
                found[rel] = path.stat().st_size
    return found


def write_manifest(folder: str | os.PathLike) -> None:
    """Write ``folder/manifest.json``: each file's relative path, size and CRC-32.

    Collective: call on every rank, once every rank's files are written (after a barrier).
    Global rank 0 lists the folder; each rank checksums its share; rank 0 writes the manifest.
    Raises the ``OSError`` of a failed read or write on the rank that met it; the other ranks
    return normally (inside ``collective_publish`` every rank then learns of it).
    """
    folder = Path(folder)
    listing, error = None, None
    if is_main_process():
        try:
            listing = _listing(folder)
        except OSError as e:
            error = e
    listing = all_gather_object(listing)[0] or {}
    sums = {}
    if error is None:
        try:
            sums = {
                rel: file_crc32(folder / rel)
                for rel in balanced_shares(listing, get_world_size())[get_rank()]
            }
        except OSError as e:
            error = e
    gathered = all_gather_object(sums)
    if is_main_process() and error is None:
        crc = {rel: c for part in gathered for rel, c in part.items()}
        if set(crc) == set(listing):  # else a rank failed to read its share, and says so
            files = {rel: {"size": listing[rel], "crc32": crc[rel]} for rel in sorted(listing)}
            text = json.dumps({"format": MANIFEST_FORMAT, "checksum": "crc32", "files": files}, indent=1)
            try:
                with naming(folder / MANIFEST_FILE), open(folder / MANIFEST_FILE, "w") as f:
                    f.write(text)
            except OSError as e:
                error = e
    if error is not None:
        raise error


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The ``files`` entries of ``folder/manifest.json`` (``{relative path: {size, crc32}}``),
    None when there is none (a checkpoint written before manifests existed). An unreadable
    manifest reads as an empty dict with the key ``"<unreadable>"`` naming the error."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {"<unreadable>": f"{MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})"}


def manifest_problems(folder: str | os.PathLike) -> list[str] | None:
    """What differs between ``folder`` and its manifest, as this rank checks it: None when
    there is no manifest, else one phrase per damaged file (empty: intact).

    Not a collective, but meant to run on every rank: sizes of every listed file here, and
    the checksums of this rank's share (``balanced_shares`` by size over the current number
    of processes), so that together the ranks read every byte once.
    """
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        return None
    if "<unreadable>" in files:
        return [files["<unreadable>"]]
    problems, intact = [], {}
    for rel, entry in files.items():
        try:
            size = (folder / rel).stat().st_size
        except FileNotFoundError:
            problems.append(f"{rel} is missing (the manifest lists {entry['size']} bytes)")
            continue
        except OSError as e:
            problems.append(f"{rel} cannot be read ({type(e).__name__}: {e})")
            continue
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            problems.append(f"{rel} has {size} bytes, the manifest says {entry['size']} ({what})")
        else:
            intact[rel] = size
    for rel in balanced_shares(intact, get_world_size())[get_rank()]:
        try:
            crc = file_crc32(folder / rel)
        except OSError as e:
            problems.append(f"{rel} cannot be read ({type(e).__name__}: {e})")
            continue
        if crc != files[rel]["crc32"]:
            problems.append(
                f"{rel} has CRC-32 {crc}, the manifest says {files[rel]['crc32']} (its bytes changed)"
            )
    return problems


__all__ = [
    "MANIFEST_FILE",
    "balanced_shares",
    "file_crc32",
    "manifest_problems",
    "read_manifest",
    "write_manifest",
]

"""The bundle: the one on-disk format every command speaks, in one package.

==============  =====================================================================================
``layout``      every path and name: the files a bundle holds, temp dirs, rank bundles, incident folders
``hashing``     sha256 of files at disk speed; the manifest's digest of itself
``schema``      strict JSON and the schema of every file (and of safetensors headers)
``tensorfile``  the one tensor writer and reader (safetensors, hashed on the way; imports torch)
``writer``      :class:`BundleWriter` and :func:`write_bundle` (atomic: temp dir, fsync, manifest last); leftovers
``reference``   state by reference: a rank's bundle that holds the owner rank's state files by digest
``reader``      :func:`verify`, :func:`open_bundle` and :class:`Bundle`
==============  =====================================================================================

Modules of this package import their siblings directly (``from reprokit.bundle.layout import MANIFEST``), never
names from this ``__init__``, which imports them all: the rest of reprokit, the tests and users import from here.
Nothing here imports torch until tensors are read or written.
"""

from reprokit.bundle.hashing import _self_digest as _self_digest  # private, but tests and their helpers read it here
from reprokit.bundle.hashing import sha256_file
from reprokit.bundle.layout import (
    CLAIM_SUFFIX,
    CODE,
    ENV,
    FAILURE,
    FORMAT,
    LAYOUT,
    LEGACY_KEYS,
    LOCAL_RNG,
    MANIFEST,
    MANIFEST_KEYS,
    REPLICATED,
    RUN,
    STATE_JSON,
    STATE_TENSORS,
    STEPS,
    TMP_PREFIX,
    VERSION,
    is_incident,
    state_file_name,
    state_files,
    step_name,
)
from reprokit.bundle.reader import (
    MAX_TOTAL_JSON_BYTES,
    UPGRADES,
    Bundle,
    folder_of_bundles,
    open_bundle,
    part_sizes,
    verify,
)
from reprokit.bundle.writer import (
    FOREIGN_AFTER_S,
    STALE_CLAIM_S,
    BundleWriter,
    Leftover,
    StepRecord,
    claimed_output,
    dumps,
    find_leftovers,
    jsonable,
    remove_leftovers,
    remove_tree,
    write_bundle,
    write_probe,
)
from reprokit.bundle.writer import _host as _host  # private, but tests read it here

__all__ = [
    "CLAIM_SUFFIX",
    "CODE",
    "ENV",
    "FAILURE",
    "FOREIGN_AFTER_S",
    "FORMAT",
    "LAYOUT",
    "LEGACY_KEYS",
    "LOCAL_RNG",
    "MANIFEST",
    "MANIFEST_KEYS",
    "MAX_TOTAL_JSON_BYTES",
    "REPLICATED",
    "RUN",
    "STALE_CLAIM_S",
    "STATE_JSON",
    "STATE_TENSORS",
    "STEPS",
    "TMP_PREFIX",
    "UPGRADES",
    "VERSION",
    "Bundle",
    "BundleWriter",
    "Leftover",
    "StepRecord",
    "claimed_output",
    "dumps",
    "find_leftovers",
    "folder_of_bundles",
    "is_incident",
    "jsonable",
    "open_bundle",
    "part_sizes",
    "remove_leftovers",
    "remove_tree",
    "sha256_file",
    "state_file_name",
    "state_files",
    "step_name",
    "verify",
    "write_bundle",
    "write_probe",
]

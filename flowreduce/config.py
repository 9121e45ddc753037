"""flowreduce's settings in the dask config: the defaults are in
``flowreduce/flowreduce.yaml`` (as distributed keeps its own in
``distributed.yaml``), the user's values wherever dask finds them
(``~/.config/dask/``, ``DASK_FLOWREDUCE__MAX_CHUNKS=...``,
``dask.config.set({"flowreduce.max-chunks": ...})``)."""

from __future__ import annotations

import pathlib
from typing import Any

import dask.config
import yaml

_DEFAULTS = yaml.safe_load((pathlib.Path(__file__).parent / "flowreduce.yaml").read_text())
dask.config.update_defaults(_DEFAULTS)


def get(key: str) -> Any:
    """The value of ``flowreduce.<key>``: the user's, else the default (also
    when a ``dask.config.set`` entered before this module was imported has
    since removed the defaults it did not know about)."""
    default = _DEFAULTS["flowreduce"]
    for part in key.split("."):
        default = default[part]
    return dask.config.get(f"flowreduce.{key}", default=default)

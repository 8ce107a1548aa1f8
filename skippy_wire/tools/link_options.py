"""The options of a driver's link to stage 0, as ``run`` and ``api`` take them: the stage
state version spoken and, under 17, the model id running stages must report."""

from __future__ import annotations

import argparse
from typing import Optional

from ..net.supervision import default_model
from ..stage.models import default_model_id
from ..wire.activation_frame import PROTOCOL_VERSIONS, STAGE_STATE_VERSION_V17
from .options import utf8


def add_link_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", type=int, default=15, choices=PROTOCOL_VERSIONS,
                   help="stage state version spoken on every link, driver included")
    p.add_argument("--model-id", default=None, type=utf8,
                   help="v17, with running stages (--connect, --topology): the model id they were given "
                        "(serve's --model-id), which stage 0's setup must report (default, as serve's: "
                        "--topology's model_id, else the model file's stem)")
    p.set_defaults(topology_model_id=None)  # --topology's model_id (options.apply_topology)


def expected_model_id(p: argparse.ArgumentParser, args, running: bool) -> Optional[str]:
    """The model id stage 0 must report: under 17 to a driver of ``running`` stages (the ones
    it starts share its whole identity); ``--model-id`` elsewhere is a usage error.  Called
    once ``--topology`` is applied, before the model is read (its file's name is enough)."""
    if args.protocol != STAGE_STATE_VERSION_V17 or not running:
        if args.model_id is not None:
            p.error("--model-id is checked only with --protocol 17 and running stages (--connect, --topology)")
        return None
    return args.model_id or args.topology_model_id or default_model_id(default_model(args.model))

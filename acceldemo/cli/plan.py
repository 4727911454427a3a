"""`python -m acceldemo plan`: what a model would get on a host you may not have."""
from __future__ import annotations

import json
import re

from ..config import Settings
from ..errors import InvalidRequest
from ..hardware import hardware_names
from ..records import Quantization
from .common import shape_arg

HELP = "what a model would get on a host you may not have: placement, degrees, memory per device, modes, batch cap"


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help=HELP, description=HELP)
    plan.add_argument("--model", action="append", dest="models", metavar="NAME",
                      help="catalog model; repeat for several (default: every real model)")
    plan.add_argument("--host", help="a host kind (trn2.48xlarge, v6e-4, h100x8, ...; `--host list` names them all; "
                                     "default: none, describe the host with the next options)")
    plan.add_argument("--hardware", choices=hardware_names(),
                      help="or describe the host: its hardware ... (default: none)")
    plan.add_argument("--devices", type=int, help="... its devices (NeuronCores, chips, GPUs) ... (default: none)")
    plan.add_argument("--device-memory", dest="device_memory", metavar="SIZE",
                      help="... memory per device (24GB; default: none)")
    plan.add_argument("--generation", default="",
                      help="... and the chip generation, where the hardware has several (TPU v6e, v6e, sm_90, "
                           "Trainium2; any case; default: none)")
    plan.add_argument("--quantization", choices=[str(q) for q in Quantization], default="none",
                      help="the weights' quantization")
    plan.add_argument("--size", type=shape_arg, metavar="WxH", help="the image size to plan for (default: the model's)")
    plan.add_argument("--json", action="store_true", help="one JSON object per model")


def known_generations(hardware: str) -> tuple[str, ...]:
    """The chip generations of a hardware, as its package names them: its host kinds' and, for TPU, those
    torch-tpu's launcher knows."""
    from ..hardware import host_kinds

    known = [kind.generation for kind in host_kinds().values() if kind.hardware == hardware and kind.generation]
    if hardware == "tpu":
        from ..hardware.tpu import TENSOR_PARALLEL_SIZES

        known += TENSOR_PARALLEL_SIZES
    return tuple(sorted(dict.fromkeys(known)))


def _generation_key(text: str, hardware: str) -> str:
    key = re.sub(r"[\s_\-]+", "", text.lower())
    return key[len(hardware):] if key.startswith(hardware) and len(key) > len(hardware) else key


def resolve_generation(hardware: str, text: str) -> str:
    """A typed chip generation (`v6e`, `tpu-v6e`, `TPU v6e`, any case) as its package names it; "" when not given;
    one the hardware does not have is refused with the list of those it has."""
    if not text.strip():
        return ""
    known = known_generations(hardware)
    found = {_generation_key(name, hardware): name for name in known}.get(_generation_key(text, hardware))
    if found is None:
        raise InvalidRequest("generation", text, f"one of {', '.join(known)} (any case; the hardware's name may be "
                                                 "left out)" if known else
                             f"no generation: {hardware} has none, leave --generation out")
    return found


def cmd_plan(args, settings: Settings) -> int:
    from ..engine.planning import described_host, named_host, plan
    from ..engine.validation import check_shape
    from ..hardware import host_kinds
    from ..models.catalog import CATALOG, get_model

    if args.host == "list":
        for kind in host_kinds().values():
            print(f"{kind.name:<15} {kind.hardware:<7} {kind.devices:>3} x {kind.memory_bytes / 1e9:6.1f} GB  "
                  f"{kind.detail}")
        return 0
    if args.host and args.hardware:
        raise InvalidRequest("host", args.host, "either --host NAME or --hardware/--devices/--device-memory, not both")
    if args.host:
        host = named_host(args.host)
    elif args.hardware and args.devices and args.device_memory:
        host = described_host(args.hardware, args.devices, args.device_memory,
                              resolve_generation(args.hardware, args.generation))
    else:
        raise InvalidRequest("host", None, "--host NAME (`--host list`) or --hardware HW --devices N "
                                           "--device-memory SIZE")
    specs = [get_model(name) for name in args.models] if args.models else \
        [spec for spec in CATALOG.values() if spec.repo]
    # The same check of the size a request gets (generate refuses 1000x1000 where the model needs multiples of 16).
    shapes = [check_shape(spec, args.size.width, args.size.height) if args.size else None for spec in specs]
    for spec, shape in zip(specs, shapes):
        planned = plan(spec, host, settings, Quantization(args.quantization), shape)
        print(json.dumps(planned.facts()) if args.json else "\n".join(planned.lines()))
    return 0

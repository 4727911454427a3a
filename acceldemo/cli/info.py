"""`python -m acceldemo info`: the hardware found and absent (with reasons), the models, the modes."""
from __future__ import annotations

import json

HELP = "hardware found and absent (with reasons), models, modes"


def add_parser(commands) -> None:
    info = commands.add_parser("info", help=HELP, description=HELP)
    info.add_argument("--json", action="store_true", help="one JSON object instead of text")


def cmd_info(args, engine) -> int:
    from ..engine import as_json

    description = engine.describe()
    if args.json:
        print(json.dumps(as_json(description), indent=2))
        return 0
    print("Hardware")
    for h in description.hardware:
        mark = "found " if h.available else "absent"
        print(f"  {h.name:<7} {mark}  {h.reason}" + (f"  modes: {', '.join(h.modes)}" if h.available else ""))
        for device in h.devices:
            print(f"    {str(device):<9} {device.memory_bytes / 1e9:>7.1f} GB  {device.detail}".rstrip())
    print(f"Models (default {description.default_model})")
    for m in description.models:
        print(f"  {m.name:<17} {m.pipeline:<25} {m.steps:>2} steps, guidance {m.guidance}, "
              f"default {m.default_size}, presets {' '.join(map(str, m.presets))}")
        print(f"      edits by {m.edits}" + (" (takes a mask)" if m.inpaints else "") + "; LoRA styles: "
              + (", ".join(f"{style['name']} (rank {style['rank']})" for style in m.loras) or "none"))
        offered = [c["name"] + (" (eager only)" if c["eager_only"] else "") for c in m.step_caches if not c["refused"]]
        print(f"      step caches: {', '.join(offered) or 'none'}; auto: {m.cache_advice['cache']} "
              f"(from {m.cache_advice['from_steps']} steps); not: "
              + "; ".join(f"{c['name']} ({c['refused']})" for c in m.step_caches if c["refused"]))
        for offer in m.offers:
            refused = [f"{o.name} ({o.reason})" for o in offer.modes if not o.ok]
            print(f"      on {offer.hardware}: placement {offer.proposal.placement} ({offer.proposal.reason}; "
                  f"up to {offer.proposal.batch} requests per call)"
                  + (f"; not: {'; '.join(refused)}" if refused else ""))
            print("        weights: " + ", ".join(f"{q['name']} {q['weight_bytes'] / 1e9:.3g} GB"
                                                  + (f" (not here: {q['refused']})" if q["refused"] else "")
                                                  for q in offer.quantizations))
    packages = description.precompiled
    print(f"Precompiled packages ({packages['setting']}): {packages['packages']} in {packages['folder']} "
          f"({packages['megabytes']} MB)")
    if packages.get("store"):
        print(f"Shared artifact store: {packages['store']['url']}")
    return 0

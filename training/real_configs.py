"""Write each real model's parameter counts beside its configs: `python -m training.real_configs`. The catalog reads
them for its weight bytes (tests/test_real_configs.py builds the components again on the meta device and checks)."""
from __future__ import annotations

import json

from acceldemo.models.real_configs import CONFIGS, PARAMETERS, count_parameters, has_configs


def main() -> None:
    for folder in sorted(CONFIGS.iterdir()):
        if not has_configs(folder.name):
            continue
        counts = count_parameters(folder.name)
        (folder / PARAMETERS).write_text(json.dumps({
            "_source": "the components built from these configs on the meta device, their parameters counted "
                       "(python -m training.real_configs)", "parameters": counts}, indent=2) + "\n")
        print(folder.name, {name: f"{count / 1e9:.3f} B" for name, count in counts.items()})


if __name__ == "__main__":
    main()

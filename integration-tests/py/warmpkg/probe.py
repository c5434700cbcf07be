# `python -m warmpkg.probe`: warm_probe.py's probe, run as a module.
import sys

WARM = "torch" in sys.modules

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))
import warm_probe  # noqa: E402

if __name__ == "__main__":
    import json
    import os

    p = warm_probe.probe()
    p["warm"] = WARM
    p["main_is_this"] = vars(sys.modules["__main__"]) is globals()
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.mod.json"), "w") as f:
        json.dump(p, f, sort_keys=True)

# Writes the worker's environment as JSON to $ENV_DUMP_DIR/rank{RANK}.json.
import json
import os

path = os.path.join(os.environ["ENV_DUMP_DIR"], f"rank{os.environ['RANK']}.json")
with open(path, "w") as f:
    json.dump(dict(os.environ), f)
